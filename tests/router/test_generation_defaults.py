"""vLLM's --generation-config: a checkpoint's generation_config.json sampling defaults fill the
fields a request leaves out (the file read, the router's Preprocessor, the offline LLM, a served
chat against the offline engine), a request's own value wins, and bad files or folders are refused
naming the flag."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from pdcluster._proto import router_pb2
from pdcluster.generation_defaults import GenerationDefaults, load_generation_defaults

GEN = {"temperature": 0.0, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.5, "max_new_tokens": 5,
       "do_sample": True, "eos_token_id": 1}


def _folder(tmp_path, content) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    return str(tmp_path)


def test_the_file_is_read_into_defaults(tmp_path):
    d = load_generation_defaults("auto", _folder(tmp_path / "m", GEN))
    assert d.sampling == {"temperature": 0.0, "top_p": 0.9, "repetition_penalty": 1.5}  # top_k 0: none
    assert d.max_tokens == 5
    assert load_generation_defaults("vllm", str(tmp_path / "m")) == GenerationDefaults()
    assert load_generation_defaults("auto", str(tmp_path / "nothing-here")) == GenerationDefaults()
    assert load_generation_defaults(str(tmp_path / "m"), None).max_tokens == 5  # a folder
    with pytest.raises(ValueError, match="--generation-config: .* does not exist"):
        load_generation_defaults(str(tmp_path / "nothing-here"), None)
    with pytest.raises(ValueError, match=r"--generation-config: .*temperature must be in \[0, 100\]"):
        load_generation_defaults("auto", _folder(tmp_path / "bad", {"temperature": -1}))
    with pytest.raises(ValueError, match="--generation-config: cannot read"):
        load_generation_defaults("auto", _folder(tmp_path / "list", [1, 2]))


def test_the_preprocessor_fills_only_what_a_request_leaves_out(demo_model, tmp_path):
    from pdcluster.engine.tokenizer import Tokenizer
    from pdcluster.router.preprocess import Preprocessor

    pre = Preprocessor(Tokenizer.from_pretrained(demo_model), served_model_names=["m"], max_model_len=256,
                       generation_defaults=load_generation_defaults("auto", _folder(tmp_path, GEN)))
    req = router_pb2.GenerateRequest(prompt="Hello")
    req.sampling_params.temperature = 0.7
    prep = asyncio.run(pre.prepare(req, None))
    sp = prep.sampling_params
    assert (sp.temperature, sp.top_p, sp.repetition_penalty) == (pytest.approx(0.7), pytest.approx(0.9), 1.5)
    assert not sp.HasField("top_k") and prep.max_tokens == 16  # completions: SamplingParams' own default
    chat = router_pb2.GenerateRequest()
    chat.chat.messages.add(role="user", content="Hi")
    chat.chat.add_generation_prompt = True
    assert asyncio.run(pre.prepare(chat, None, chat_max_tokens_default=True)).max_tokens == 5  # max_new_tokens
    chat.sampling_params.max_tokens = 9
    assert asyncio.run(pre.prepare(chat, None, chat_max_tokens_default=True)).max_tokens == 9


def test_offline_llm_default_params(demo_model, tmp_path):
    import shutil

    from pdcluster import LLM

    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    _folder(model, {**json.loads((model / "generation_config.json").read_text()), **GEN})
    llm = LLM(str(model), max_model_len=256)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.repetition_penalty, p.max_tokens) == (0.0, 0.9, 1.5, 5)
    out = llm.generate(["Hello"])[0].outputs[0]
    from pdcluster import SamplingParams

    assert out.token_ids == llm.generate(["Hello"], SamplingParams(temperature=0.0, top_p=0.9, repetition_penalty=1.5,
                                                                   max_tokens=5))[0].outputs[0].token_ids
    plain = LLM(str(model), max_model_len=256, generation_config="vllm").get_default_sampling_params()
    assert plain == SamplingParams()


def test_served_chat_takes_the_defaults(cluster, reference, tmp_path):
    c = cluster(1, generation_config=_folder(tmp_path, GEN))
    oa = openai.OpenAI(base_url=c.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Say something."}]
    r = oa.chat.completions.create(model=c.router.preprocessor.model_name, messages=msgs,
                                   extra_body={"ignore_eos": True})
    want = reference.chat(msgs, max_tokens=5, temperature=0.0, top_p=0.9, repetition_penalty=1.5)
    assert r.usage.completion_tokens == 5 and r.choices[0].message.content == want.text
    r = oa.chat.completions.create(model=c.router.preprocessor.model_name, messages=msgs, max_tokens=4,
                                   extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
    assert r.choices[0].message.content == reference.chat(msgs, max_tokens=4, temperature=0.0, top_p=0.9).text
