"""`serve` stops its workers before its router: on Ctrl-C / SIGTERM the workers drain (their running
requests finish) while the router still streams their output to the clients, then the router stops.
A real router in a real process, a recording launcher in place of the worker processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap


def test_workers_are_stopped_while_the_router_still_serves(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = textwrap.dedent(f"""
        import json, os, signal, socket, threading, time
        from pdcluster.cluster.router_cmd import run_router_foreground
        from pdcluster.models.demo import ensure_demo_model
        from pdcluster.router.config import RouterConfig

        class RecordingLauncher:
            processes = []
            calls = []
            def newly_exited(self):
                return []
            def stop(self):  # the router must still accept connections now
                with socket.create_connection(("127.0.0.1", {port}), timeout=5):
                    self.calls.append("stop while the router listens")

        launcher = RecordingLauncher()
        config = RouterConfig(host="127.0.0.1", grpc_port={port}, http_port=None, insecure=True,
                              model=str(ensure_demo_model("model")))

        def terminate_once_listening():  # SIGTERM only after the router installed its handlers
            while True:
                try:
                    socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
                    break
                except OSError:
                    time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=terminate_once_listening, daemon=True).start()
        run_router_foreground(config, wait_for_workers=0, launcher=launcher)
        print("CALLS " + json.dumps(launcher.calls))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("CALLS "))
    assert json.loads(line[6:]) == ["stop while the router listens"]
