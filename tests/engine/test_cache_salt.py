"""cache_salt (vLLM's prefix-cache isolation): the salt keys a prompt's first block, so requests
with different salts never share cached KV, and the router hashes salted prompts as workers do."""

from __future__ import annotations

import random

import pytest

from pdcluster import LLM, SamplingParams
from pdcluster.engine.block_hash import compute_block_hashes
from pdcluster.proto_convert import InvalidField, sampling_params_from_proto, sampling_params_to_proto
from pdcluster.sampling_params import MAX_CACHE_SALT_CHARS

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_salt_changes_every_block_and_nothing_else() -> None:
    tokens = list(range(3, 3 + 4 * 16))
    plain = compute_block_hashes(tokens, 16)
    a = compute_block_hashes(tokens, 16, cache_salt="a")
    assert compute_block_hashes(tokens, 16, cache_salt=None) == plain  # unsalted: the wire format as before
    assert compute_block_hashes(tokens, 16, cache_salt="a") == a
    assert all(x != y for x, y in zip(plain, a, strict=True))  # the chain carries block 0's salt on
    assert all(x != y for x, y in zip(a, compute_block_hashes(tokens, 16, cache_salt="b"), strict=True))
    # A salt and an extra key of the same text are different keys.
    assert compute_block_hashes(tokens, 16, extra_keys=("a",)) != a


@pytest.mark.parametrize("salt,message", [
    ("", "non-empty"), (7, "non-empty string"), ("x" * (MAX_CACHE_SALT_CHARS + 1), f"at most {MAX_CACHE_SALT_CHARS}"),
    ("\ud800", "unpaired surrogates"),
])
def test_bad_salts_are_refused_by_name(salt, message) -> None:
    with pytest.raises(ValueError, match=f"cache_salt.*{message}"):
        SamplingParams(cache_salt=salt)


def test_salt_travels_in_the_proto() -> None:
    params = GREEDY.replace(cache_salt="tenant-7")
    assert sampling_params_from_proto(sampling_params_to_proto(params)).cache_salt == "tenant-7"
    assert not sampling_params_to_proto(GREEDY).HasField("cache_salt")
    msg = sampling_params_to_proto(GREEDY)
    msg.cache_salt = ""
    with pytest.raises(InvalidField) as e:
        sampling_params_from_proto(msg)
    assert e.value.field == "cache_salt"


def test_salts_isolate_the_prefix_cache(demo_model: str) -> None:
    llm = LLM(demo_model, dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=256)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(70)]  # 4 full blocks + 6 tokens
    try:
        first = llm.generate([prompt], GREEDY.replace(cache_salt="tenant-a"))[0]
        assert first.num_cached_tokens == 0
        runs = {}
        for name, params in (("other salt", GREEDY.replace(cache_salt="tenant-b")), ("no salt", GREEDY),
                             ("same salt", GREEDY.replace(cache_salt="tenant-a"))):
            out = llm.generate([prompt], params)[0]
            runs[name] = out
            assert out.outputs[0].token_ids == first.outputs[0].token_ids, name
        assert runs["other salt"].num_cached_tokens == 0
        assert runs["no salt"].num_cached_tokens == 0
        assert runs["same salt"].num_cached_tokens == 64
        # Now the unsalted prompt is cached too, and hits without a salt only.
        assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 64
        assert llm.generate([prompt], GREEDY.replace(cache_salt="tenant-c"))[0].num_cached_tokens == 0
    finally:
        llm.shutdown()


def test_the_router_hashes_salted_prompts_as_the_engine_does(demo_model: str) -> None:
    from pdcluster.router.policies import PrefixAware, RouteRequest
    from pdcluster.router.prefix_index import PrefixIndex

    llm = LLM(demo_model, dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=256)
    prompt = list(range(5, 5 + 50))
    try:
        manager = llm.engine.core.scheduler.kv
        seen: dict[str, list[bytes]] = {}
        original = manager.update_block_hashes

        def spy(request):
            original(request)
            seen[request.sampling_params.cache_salt or ""] = list(request.block_hashes)

        manager.update_block_hashes = spy
        llm.generate([prompt], GREEDY.replace(cache_salt="s1"))
        llm.generate([prompt], GREEDY)
    finally:
        llm.shutdown()
    policy = PrefixAware(PrefixIndex(), block_size=16)
    salted = policy.block_hashes(RouteRequest("r", prompt, cache_salt="s1"))
    plain = policy.block_hashes(RouteRequest("r", prompt))
    assert list(salted) == seen["s1"][:3] and list(plain) == seen[""][:3]
    assert salted != plain
