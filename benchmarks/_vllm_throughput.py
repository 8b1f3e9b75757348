"""Run inside a venv with vLLM's CPU build: prints one JSON line with the elapsed time.

Usage: python _vllm_throughput.py MODEL WORKLOAD_JSON
    (workload: {"prompts": [[ids]], "max_tokens": [n], "repeats": r, "dtype": "bfloat16" | "float32",
                optional "speculative_config": {...}, "max_model_len": n, "return_tokens": bool})
"""

import json
import sys
import time

if __name__ == "__main__":  # vLLM's LLM must be created under __main__ (it spawns processes)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, workload = sys.argv[1], json.load(open(sys.argv[2]))
    extra = {"speculative_config": workload["speculative_config"]} if workload.get("speculative_config") else {}
    llm = LLM(model=model, dtype=workload.get("dtype", "bfloat16"), max_model_len=workload.get("max_model_len", 1024),
              enforce_eager=False, seed=0, gpu_memory_utilization=0.3, **extra)  # on CPU: the share of RAM vLLM reserves
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload["max_tokens"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    times = []
    for _ in range(workload.get("repeats", 1)):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"times": times, "generated": gen}
    if workload.get("return_tokens"):
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps(result))
