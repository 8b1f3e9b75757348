"""Tensor parallelism inside one worker (DESIGN.md section 2: TP process groups, step broadcast).

    executor.py     TPExecutor: EngineCore's runner when tensor_parallel_size > 1 (rank 0)
    launcher.py     starts ranks 1..t-1 as child processes, watches them, stops them
    rank_main.py    a child rank's loop: receive step, run the model shard
    group.py        TPGroup: the collectives (gloo / NCCL) and the byte broadcast
    comm.py         TPComm: the protocol the TP layers call
    step_codec.py   SchedulerOutput <-> msgpack (no pickle across processes)
    config_codec.py EngineConfig <-> plain dict (rank bootstrap)
    errors.py       TPRankFailedError

Nothing is imported here, and nothing in pdcluster/engine imports this package (it is built on
the engine): the engine's executor registry names TPExecutor ("tp" in engine/executor.py) and
loads it only when tensor_parallel_size > 1; a builder may also pass it in as `executor=`.
"""
