"""Tokenizer: a Hugging Face tokenizer directory served by the `tokenizers` library alone.

Reads what `transformers.AutoTokenizer` reads for fast tokenizers and encodes the same ids:
- tokenizer.json (required): model, normalizer, pre-tokenizer, decoder, post-processor, added tokens.
- tokenizer_config.json: bos/eos/unk/pad/... tokens (strings or AddedToken dicts),
  `added_tokens_decoder`, extra special tokens, `chat_template`.
- chat_template.jinja (wins over the config's template, as in transformers' save format).
- generation_config.json: extra `eos_token_id`s (Llama-3 instruct ends turns with <|eot_id|>).

Chat templates come from the model repository, so they are untrusted code: they render in
jinja2's ImmutableSandboxedEnvironment with the same helpers transformers provides.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: dict[str, str] | None = None,
        *,
        extra_special_tokens: list[str] | None = None,
        chat_template: str | None = None,
        named_chat_templates: dict[str, str] | None = None,
        generation_eos_token_ids: list[int] | None = None,
    ) -> None:
        self.backend = backend
        # Serving encodes one text at a time: a max_length or padding baked into tokenizer.json must
        # never silently truncate or pad a prompt.
        backend.no_truncation()
        backend.no_padding()
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.extra_special_tokens = list(extra_special_tokens or [])
        # Like transformers: a named special token missing from the vocab is added as a special token.
        named = [*self.special_tokens.values(), *self.extra_special_tokens]
        missing = dict.fromkeys(t for t in named if backend.token_to_id(t) is None)
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        # Special tokens added by encode() come from tokenizer.json's post-processor alone (e.g.
        # Llama-3's TemplateProcessing adds <|begin_of_text|>). transformers >= 5 does the same: it
        # drops tokenizer_config's add_bos_token/add_eos_token whenever tokenizer.json exists
        # (transformers 4 let them rebuild the post-processor). The flags report what encode does.
        probe = backend.encode("", add_special_tokens=True).ids
        self.add_bos_token = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self.add_eos_token = self.eos_token_id is not None and probe[-1:] == [self.eos_token_id]
        self.chat_template = chat_template
        self.named_chat_templates = dict(named_chat_templates or {})
        self._compiled: dict[str, jinja2.Template] = {}  # compiled once per template text
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos + list(generation_eos_token_ids or [])))
        vocab = backend.get_vocab(with_added_tokens=True)
        # Number of valid ids (max id + 1), added tokens included: HF's len(tokenizer), which is what
        # bounds sampling. (HF's `vocab_size` is the base vocabulary without added tokens.)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        added = backend.get_added_tokens_decoder()
        names = [*self.special_tokens.values(), *self.extra_special_tokens]
        ids = [backend.token_to_id(t) for t in names] + [i for i, t in sorted(added.items()) if t.special]
        self.all_special_ids: list[int] = list(dict.fromkeys(i for i in ids if i is not None))
        self.all_special_tokens: list[str] = [backend.id_to_token(i) for i in self.all_special_ids]

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: pdcluster needs a fast tokenizer (tokenizer.json) in {root}"
            )
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")
        special: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _token_content(config.get(name, special_map.get(name)))
            if value is not None:
                special[name] = value
        extra_raw = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra_raw, dict):  # transformers 5 also allows {name: token}
            extra_raw = list(extra_raw.values())
        extra = [c for c in (_token_content(t) for t in extra_raw) if c is not None]
        _add_config_added_tokens(backend, config.get("added_tokens_decoder") or {})
        default_template, named = _chat_templates(config.get("chat_template"))
        template_file = root / "chat_template.jinja"
        if template_file.is_file():
            default_template = template_file.read_text(encoding="utf-8")
        gen_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        gen_eos_list = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        gen_eos_ids = [i for i in gen_eos_list if isinstance(i, int) and not isinstance(i, bool)]
        return cls(
            backend,
            special,
            extra_special_tokens=extra,
            chat_template=default_template,
            named_chat_templates=named,
            generation_eos_token_ids=gen_eos_ids,
        )

    # -- special tokens -----------------------------------------------------------------------
    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def __len__(self) -> int:
        return self.vocab_size

    # -- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # transformers' clean_up_tokenization_spaces is deliberately not applied: it rewrites text
        # (" ." -> ".") and cannot be applied incrementally, so streamed text would not add up.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render messages with the model's chat template (or `chat_template`: a template name from
        the config's list, or the template text). Extra keyword arguments become template variables,
        as in transformers. With tokenize=True returns ids, encoded without adding special tokens
        unless add_special_tokens (the template writes them). continue_final_message: the text ends
        with the last message's content, left open (no end-of-turn), so the model continues it."""
        template = self._resolve_template(chat_template)
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("chat messages must be a list of dicts")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        # Like transformers: keys set to None are dropped; templates test for presence, not None.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **template_kwargs}
        compiled = self._compiled.get(template)
        if compiled is None:
            compiled = compile_chat_template(template)
            # Only the tokenizer's own templates are cached: caller-supplied ones would grow it unbounded.
            if template == self.chat_template or template in self.named_chat_templates.values():
                self._compiled[template] = compiled
        text = compiled.render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        if continue_final_message:
            text = _cut_after_final_message(text, chat[-1] if chat else {})
        return self.encode(text, add_special_tokens=add_special_tokens) if tokenize else text

    def _resolve_template(self, chat_template: str | None) -> str:
        if chat_template is not None:
            return self.named_chat_templates.get(chat_template, chat_template)
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template: start the server with --chat-template "
                             "FILE (or pass one explicitly)")
        return self.chat_template


# -- config helpers ---------------------------------------------------------------------------
def _cut_after_final_message(text: str, final: dict[str, Any]) -> str:
    """The rendered chat up to the end of the final message's content (its last occurrence; the
    template may strip the content's edges). Whatever the template writes after it (end of turn,
    eos) goes, so the model continues the message."""
    content = final.get("content")
    if isinstance(content, list):  # typed parts: the last text part ends the message
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the final message has no text to continue")
    for piece in (content, content.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[: at + len(piece)]
    raise ValueError("continue_final_message: the chat template does not write the final message's text as given")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict ({"content": ..., ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _add_config_added_tokens(backend: BackendTokenizer, decoder: dict[str, Any]) -> None:
    missing = []
    for spec in decoder.values():
        content = _token_content(spec)
        if content is not None and backend.token_to_id(content) is None:
            missing.append(
                AddedToken(
                    content,
                    special=bool(spec.get("special", False)),
                    single_word=bool(spec.get("single_word", False)),
                    lstrip=bool(spec.get("lstrip", False)),
                    rstrip=bool(spec.get("rstrip", False)),
                    normalized=bool(spec.get("normalized", not spec.get("special", False))),
                )
            )
    if missing:
        backend.add_tokens(missing)


def _chat_templates(value: Any) -> tuple[str | None, dict[str, str]]:
    """tokenizer_config's chat_template: one string, or a list of {"name", "template"}."""
    if isinstance(value, str):
        return value, {}
    named: dict[str, str] = {}
    if isinstance(value, list):
        for item in value:
            if not isinstance(item, dict):
                continue
            name, template = item.get("name"), item.get("template")
            if isinstance(name, str) and isinstance(template, str):
                named[name] = template
    return named.get("default"), named


# -- jinja --------------------------------------------------------------------------------------
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; serving only needs the body rendered."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat template may not set namespace attribute {name!r}")


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attributes, so a template cannot plant dunder names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature, frees "self" as a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '), which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: the path of a file holding a Jinja chat template, or the template
    text itself. Compiled here, so a template that cannot compile is refused at start-up."""
    if "\n" not in value and "{" not in value:  # only then can it be a path
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r}: no such file (give a template file or the template "
                             "text itself)")
        if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
            raise ValueError(f"--chat-template {value!r}: larger than {MAX_CHAT_TEMPLATE_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    else:
        text = value
    if len(text.encode()) > MAX_CHAT_TEMPLATE_BYTES:
        raise ValueError(f"--chat-template: larger than {MAX_CHAT_TEMPLATE_BYTES} bytes")
    try:
        compile_chat_template(text)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template: the template does not compile: {e}") from None
    return text


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile an (untrusted) chat template in the sandbox with transformers' helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_TemplateNamespace, dict=_dict
    )
    return env.from_string(template)
