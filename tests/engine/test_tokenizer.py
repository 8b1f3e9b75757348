"""Tokenizer vs transformers' AutoTokenizer on small byte-level BPE tokenizers trained here, saved
in the Llama-3 and Qwen2 layouts by transformers itself."""

from __future__ import annotations

import json
import pathlib

import jinja2
import pytest
from tokenizers import Regex, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders as tk_decoders
from tokenizers import models as tk_models

from pdcluster.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. It's 2024, isn't it?",
    "Le café est très bon. Ça va? 你好，世界！今天天气很好。日本語のテキスト。",
    "Emoji: 😀🎉👍🚀 and flags 🇫🇷; math ∑ ∫ √ ≈ ≠.",
    "def f(x):\n    return x * 2  # comment\n\n\tindent\r\n",
] * 20
TEXTS = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "Ça va? 你好世界 😀🎉 unseen-word ZYXW",
    "line1\nline2\r\n\tTabbed\n\n",
    "It's 12345 o'clock",
    "special <|eot_id|> and <|im_end|> inside text",
    "",
]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.index0 == 0 and message['role'] == 'system' %}{% set sys = true %}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are helpful.' }}{%- endif %}
{{- "\\n\\n# Tools\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
  {%- if message.role not in ['system', 'user', 'assistant'] %}
    {{- raise_exception('unknown role ' + message.role) }}
  {%- endif %}
  {%- if not (message.role == 'system' and loop.first) %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{ message.content }}{% endgeneration %}{{ '<|im_end|>\\n' }}
    {%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
    {%- if message.tool_calls is defined %}{{ 'tools!' }}{% break %}{% endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
CHATS = [
    [{"role": "user", "content": "Hello 😀!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "},
     {"role": "assistant", "content": "Hi there.", "tool_calls": None}, {"role": "user", "content": "你好"}],
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "Weather <in> a city & more",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]


def train_backend(split: str, specials: list[str], nfc: bool = False) -> BackendTokenizer:
    tok = BackendTokenizer(tk_models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = tk_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def save_llama3(path: pathlib.Path) -> pathlib.Path:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]
    tok = train_backend(LLAMA3_SPLIT, specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                              eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)
    hf.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    return path


def save_qwen(path: pathlib.Path) -> pathlib.Path:
    tok = train_backend(QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], nfc=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                              pad_token="<|endoftext|>", add_bos_token=False,
                                              chat_template=QWEN_TEMPLATE)
    hf.save_pretrained(path)
    return path


def _edit_json(path: pathlib.Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def save_llama3_no_bos(path: pathlib.Path) -> pathlib.Path:
    """An older-style config with add_bos_token=false next to tokenizer.json's TemplateProcessing."""
    save_llama3(path)
    _edit_json(path / "tokenizer_config.json", add_bos_token=False)
    return path


def save_bos_eos_override(path: pathlib.Path) -> pathlib.Path:
    """No post-processor in tokenizer.json (as older repos); the config asks for bos and eos, the bos
    given as an AddedToken dict, and has a list of named chat templates."""
    tok = train_backend(QWEN_SPLIT, ["<s>", "</s>"])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.save_pretrained(path)
    _edit_json(path / "tokenizer.json", post_processor=None)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, add_eos_token=True)
    config["bos_token"] = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False,
                           "special": True}
    config["chat_template"] = [{"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "TOOLS{{ eos_token }}"}]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


MAKERS = {"llama3": save_llama3, "qwen": save_qwen, "llama3_no_bos": save_llama3_no_bos,
          "override": save_bos_eos_override}


@pytest.fixture(scope="module", params=list(MAKERS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    maker = MAKERS[request.param]
    path = maker(tmp_path_factory.mktemp(request.param))
    return request.param, Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens: bool) -> None:
    _, ours, hf = pair
    for text in TEXTS:
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens) == expected, text


def test_decode_matches_transformers(pair) -> None:
    _, ours, hf = pair
    for text in TEXTS:
        ids = hf.encode(text)
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert ours.decode(ids, skip_special_tokens=skip) == expected


def test_special_tokens_match_transformers(pair) -> None:
    _, ours, hf = pair
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.vocab_size == len(hf)
    # Ours also lists every added token marked special (all of them are skipped by decode).
    assert set(hf.all_special_ids) <= set(ours.all_special_ids)


def test_chat_template_matches_transformers(pair) -> None:
    name, ours, hf = pair
    for chat in CHATS:
        for gen in (True, False):
            expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected
            ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True) == ids
    if name == "qwen":
        expected = hf.apply_chat_template(CHATS[0], tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(CHATS[0], tools=TOOLS) == expected
        assert '"description": "Weather <in> a city & more"' in expected  # tojson does not HTML-escape


def test_continue_final_message_matches_transformers(pair) -> None:
    """The prompt ends inside the final (assistant) message, as transformers cuts it."""
    _, ours, hf = pair
    for chat in ([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Well, I"}],
                 [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " padded words  "}]):
        try:
            expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=False,
                                              continue_final_message=True)
        except ValueError:  # a template that does not write the message: refused alike
            with pytest.raises(ValueError, match="continue_final_message: the chat template does not write"):
                ours.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
            continue
        got = ours.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
        assert got == expected and got.endswith((chat[-1]["content"], chat[-1]["content"].strip()))
        assert ours.apply_chat_template(chat, False, True, continue_final_message=True) == ours.encode(
            expected, add_special_tokens=False)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        ours.apply_chat_template(CHATS[0], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message: the final message has no text"):
        ours.apply_chat_template([{"role": "user", "content": "  "}], False, continue_final_message=True)


def test_llama3_layout_details(tmp_path: pathlib.Path) -> None:
    path = save_llama3(tmp_path)
    assert (path / "chat_template.jinja").is_file()  # transformers' save format
    tok = Tokenizer.from_pretrained(path)
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.eos_token_ids == (4, 1)  # tokenizer eos first, then generation_config's


def test_tokenizer_json_post_processor_decides(tmp_path: pathlib.Path) -> None:
    """As in transformers >= 5, add_bos_token/add_eos_token in the config do not override
    tokenizer.json (the parametrized tests check transformers agrees)."""
    no_bos = Tokenizer.from_pretrained(save_llama3_no_bos(tmp_path / "a"))
    assert no_bos.add_bos_token and no_bos.encode("hi")[0] == no_bos.bos_token_id
    none = Tokenizer.from_pretrained(save_bos_eos_override(tmp_path / "b"))
    assert not none.add_bos_token and not none.add_eos_token
    assert none.encode("hi") == none.encode("hi", add_special_tokens=False)


def test_named_chat_templates(tmp_path: pathlib.Path) -> None:
    tok = Tokenizer.from_pretrained(save_bos_eos_override(tmp_path))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"
    assert tok.apply_chat_template([], chat_template="tool_use") == "TOOLS</s>"
    assert tok.apply_chat_template([], chat_template="{{ 1 + 1 }}") == "2"


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_template_is_sandboxed_and_can_raise(tmp_path: pathlib.Path) -> None:
    tok = Tokenizer.from_pretrained(save_qwen(tmp_path))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([], chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([], chat_template="{{ [].append(1) }}")  # immutable sandbox
    with pytest.raises(ValueError, match="list of dicts"):
        tok.apply_chat_template(["not a dict"])  # type: ignore[list-item]
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
