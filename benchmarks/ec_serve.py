"""TTFT of multimodal requests served with an encode worker (E+P+D) vs without one (P+D).

    python benchmarks/ec_serve.py [--layout epd|pd|both] [--images 1,4] [--num-prompts 8]

Builds a small random LLaVA with transformers (CLIP tower: 224 px, patch 16 -> 196 placeholders,
hidden 512, 12 layers, so the tower costs something on a CPU; a tiny Llama decoder), starts
`pdcluster serve` with `--encode 1 --prefill 1 --decode 1` and/or `--prefill 1 --decode 1`, and runs
`pdcluster bench serve --backend openai-chat --dataset-name random-mm` against it (224x224 random
images, N per request, one request at a time so TTFT is latency, not queueing). random-mm never
repeats an image, so this measures the extra hop (Encode RPC + EC fetch) against local encoding,
not sharing (benchmarks/ec_ttft.py measures a request whose encoding already exists and is fetched).
Prints one line per (layout, images): mean / median / p99 TTFT in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB, IMAGE_TOKEN_ID = 384, 383
TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
LAYOUTS = {"epd": ["--encode", "1", "--prefill", "1", "--decode", "1"], "pd": ["--prefill", "1", "--decode", "1"]}


def make_llava(path: str) -> str:
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tf.utils.logging.disable_progress_bar()
    text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    vision = tf.CLIPVisionConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                                 num_attention_heads=8, image_size=224, patch_size=16, projection_dim=128)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID)
    torch.manual_seed(0)
    tf.LlavaForConditionalGeneration(cfg).eval().save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<image>": IMAGE_TOKEN_ID}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.save(f"{path}/tokenizer.json")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)
    tf.CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(path)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(TEMPLATE)
    return path


def start_serve(model: str, layout: str) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--model", model, *LAYOUTS[layout],
           "--grpc-port", "0", "--http-port", "0", "--policy", "round_robin", "--max-message-bytes", str(32 << 20),
           "--worker-args", f"--max-model-len 2048 --num-kv-blocks 512 --max-message-bytes {32 << 20}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("PDCLUSTER_READY "):
            return proc, json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"serve exited with {proc.wait()}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def bench(model: str, http: str, images: int, num_prompts: int, out_dir: str) -> dict:
    name = f"r{images}-{time.time_ns()}.json"
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "bench", "serve", "--backend", "openai-chat",
           "--base-url", http, "--tokenizer", model, "--dataset-name", "random-mm", "--num-prompts", str(num_prompts),
           "--random-input-len", "32", "--random-output-len", "4", "--ignore-eos", "--max-concurrency", "1",
           "--random-mm-base-items-per-request", str(images),
           "--random-mm-limit-mm-per-prompt", json.dumps({"image": images, "video": 0}),
           "--random-mm-bucket-config", "{(224, 224, 1): 1.0}", "--num-warmups", "2",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", out_dir, "--result-filename", name,
           "--disable-tqdm"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(f"{out_dir}/{name}") as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=("epd", "pd", "both"), default="both")
    p.add_argument("--images", default="1,4")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--model", default=None, help="a LLaVA checkpoint (default: build the small random one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ec-serve-") as tmp:
        model = args.model or make_llava(f"{tmp}/llava")
        for layout in (("epd", "pd") if args.layout == "both" else (args.layout,)):
            proc, ready = start_serve(model, layout)
            try:
                for n in (int(x) for x in args.images.split(",")):
                    r = bench(model, ready["http"], n, args.num_prompts, tmp)
                    print(f"{layout:4s} images={n}  TTFT ms: mean {r['mean_ttft_ms']:.1f}  median "
                          f"{r['median_ttft_ms']:.1f}  p99 {r['p99_ttft_ms']:.1f}  "
                          f"({r['completed']}/{args.num_prompts} ok)", flush=True)
            finally:
                stop(proc)


if __name__ == "__main__":
    main()
