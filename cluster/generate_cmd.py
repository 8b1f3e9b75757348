"""`pdcluster generate`: stream one completion to the terminal, locally or through a router."""

from __future__ import annotations

import argparse
import sys


def run_generate(args: argparse.Namespace) -> int:
    from pdcluster.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.router:
        import os

        from pdcluster.client import Client, ClientError
        from pdcluster.worker.tls import TLSConfig

        tls = TLSConfig(ca=args.tls_ca) if args.tls_ca else None
        try:
            with Client(args.router, api_key=args.api_key or os.environ.get("PDCLUSTER_API_KEY"), tls=tls) as client:
                for delta in client.generate_stream(args.prompt, params, chat=args.chat):
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
        except ClientError as e:
            print(f"pdcluster generate: error: {e}", file=sys.stderr)
            return 1
        sys.stdout.write("\n")
        return 0
    from pdcluster.config import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype=args.dtype))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, tokenize=False)
    sys.stdout.write(args.prompt if not args.chat else "")
    request_id = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
    final = engine.get_final(request_id)
    sys.stdout.write(f"\n[{len(final.outputs[0].token_ids)} tokens, finish_reason={final.outputs[0].finish_reason}]\n")
    return 0
