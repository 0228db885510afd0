"""DraftModelProposer end to end on tiny in-process models (fp32, CPU).

Target: the conftest's tiny llama over the character-level tokenizer. Drafts that agree with it
often, so that acceptance is not trivial:
  same : the target's weights, perturbed (same tokenizer: ids pass straight through);
  byte : a byte-level BPE tokenizer ('Ġ' markers, a few merges, other ids) whose single-byte tokens
         carry the target's embedding and head rows for the same character (then perturbed); merged
         and non-ASCII tokens get random rows. It drafts through the token-level intersection (tli)
         or, forced, through text.
Invariants: greedy with the draft == greedy without (>= 20 prompts, every mode); sampling keeps the
target distribution (exact marginals by enumeration); the draft's KV cache is rolled back with the
target's and never re-prefilled; a map built for another pair is refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specctl.config import SpecConfig
from specctl.errors import DataError, UsageError
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.proposers import DraftRequest, build_proposer
from specctl.runtime.proposers.draft_model import DraftModelProposer
from specctl.runtime.rejection import logits_to_probs
from specctl.runtime.loading import load_model
from specctl.runtime.runner import TargetRunner
from specctl.testing import emitted_histograms, exact_marginals, null_tv_quantile
from specctl.drafts.vocab_map import build_vocab_map

MAX_LEN = 128
NEW = 24
NEAR_TIE = 1e-4
K = 4
SAME_NOISE = 0.02  # relative weight noise of the drafts: acceptance well inside (0, 1)
BYTE_NOISE = 0.02
DRAFT_T = 0.6  # the draft samples hotter than the target in the sampling test: q != p


# --------------------------------------------------------------------------- tiny models

def _b2u() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


B2U = _b2u()
BYTE_SPECIALS = ("<|im_end|>", "<unk>", "</s>", "<|im_start|>", "<s>", "<pad>")  # the target's, reordered
BYTE_MERGES = (("q", "u"), ("Ġ", "{"), ("z", "Ġ"), ("Ã", "©"))
EXTRAS = tuple(f"<extra_{i}>" for i in range(25))  # the target's padding tokens, as added (non-special) tokens


def byte_level_tokenizer():
    """GPT-2 style byte-level BPE: specials, \\t \\n and printable ASCII shuffled, 'Ã' '©', 4 merges,
    then the target's <extra_i> as added tokens (a random target emits them; the draft must read them)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [B2U[b] for b in [9, 10, *range(32, 127)]]
    np.random.default_rng(7).shuffle(chars)
    tokens = list(BYTE_SPECIALS) + chars + ["Ã", "©"] + ["".join(m) for m in BYTE_MERGES]
    raw = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=list(BYTE_MERGES), unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(BYTE_SPECIALS))
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRAS])
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>")


def _perturb(model, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def draft_dirs(tiny_model_dir, tmp_path_factory):
    """{"same": folder, "byte": folder}: the two drafts of the module docstring."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    target_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = {}

    same = tmp_path_factory.mktemp("draft-same")
    draft = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    _perturb(draft, SAME_NOISE, seed=1)
    draft.save_pretrained(same)
    target_tok.save_pretrained(same)
    out["same"] = same

    btok = byte_level_tokenizer()
    u2b = {c: b for b, c in B2U.items()}
    tvocab = target_tok.get_vocab()
    V = len(btok) + 2  # two head rows no token spells
    cfg = hf.config.__class__(**{**hf.config.to_dict(), "vocab_size": V})
    torch.manual_seed(3)
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    draft.load_state_dict({k: v for k, v in hf.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k},
                          strict=False)
    emb, head = draft.model.embed_tokens.weight, draft.lm_head.weight
    with torch.no_grad():
        for tok, j in btok.get_vocab().items():
            text = tok if tok in BYTE_SPECIALS + EXTRAS else (chr(u2b[tok]) if len(tok) == 1 and u2b[tok] < 128 else None)
            if text is not None and text in tvocab:
                emb[j] = hf.model.embed_tokens.weight[tvocab[text]]
                head[j] = hf.lm_head.weight[tvocab[text]]
    _perturb(draft, BYTE_NOISE, seed=2)
    byte = tmp_path_factory.mktemp("draft-byte")
    draft.save_pretrained(byte)
    btok.save_pretrained(byte)
    out["byte"] = byte
    return out


@pytest.fixture(scope="module")
def drafts(draft_dirs):
    return {name: load_model(d, dtype="float32") for name, d in draft_dirs.items()}


def make_proposer(target, draft, mode=None, k=K, **kw) -> DraftModelProposer:
    cfg = SpecConfig.from_dict({"method": "draft_model", "model": "unused", "num_speculative_tokens": k})
    return DraftModelProposer(cfg, target=target, max_model_len=MAX_LEN, draft=draft, mode=mode, **kw)


def random_text_prompts(n: int, seed: int) -> list[list[int]]:
    """Printable-ASCII prompts (target ids 8..102) of 8 to 20 characters."""
    rng = np.random.default_rng(seed)
    return [rng.integers(8, 103, int(rng.integers(8, 21))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def greedy_cases(target):
    plain = SpecDecoder(TargetRunner(target.model, MAX_LEN))
    cases = []
    for prompt in random_text_prompts(30, seed=0):
        res = plain.generate(prompt, SamplingParams(max_new_tokens=NEW, record_margins=True))
        if min(res.margins) >= NEAR_TIE:
            cases.append((prompt, res.token_ids))
    assert len(cases) >= 20
    return cases


# --------------------------------------------------------------------------- construction


def test_modes_are_picked_from_the_tokenizers(target, drafts):
    assert make_proposer(target, drafts["same"]).mode == "same"
    p = make_proposer(target, drafts["byte"])
    assert p.mode == "auto" and p.vocab_map is not None
    # every single ASCII byte token of the draft maps to the target's character, merges are suppressed
    btok, ttok = drafts["byte"].tokenizer, target.tokenizer
    for dtok, ttext in (("Ġ", " "), ("Ċ", "\n"), ("ĉ", "\t"), ("a", "a"), ("<|im_end|>", "<|im_end|>")):
        assert int(p.d2t[btok.convert_tokens_to_ids(dtok)]) == ttok.convert_tokens_to_ids(ttext), dtok
    for dtok in ("qu", "Ġ{", "Ã©", "Ã"):
        i = btok.convert_tokens_to_ids(dtok)
        assert int(p.d2t[i]) == -1 and bool(p.suppress_tli[i]) and not bool(p.suppress_text[i])
    assert bool(p.suppress_tli[-1]) and bool(p.suppress_text[-2])  # head rows without a token: never drafted
    with pytest.raises(UsageError, match="does not fit"):
        make_proposer(target, drafts["byte"], mode="same")
    with pytest.raises(UsageError, match="does not fit"):
        make_proposer(target, drafts["same"], mode="tli")


def test_auto_drafts_by_text_where_the_tokenizers_cut_differently(target, drafts):
    """'ququ...' is 'q' 'u' ... for the target but 'qu' 'qu' ... for the draft: no target token of it is a
    draft token, so the intersection could never propose one; plain letters are cut alike."""
    ttok = target.tokenizer
    for text, expected in (("ququququququququququququ", "text"), ("abcdefghijklmnopqrstuvwx", "tli")):
        prop = make_proposer(target, drafts["byte"])
        prompt = ttok.encode(text, add_special_tokens=False)
        prop.start_request(0, np.asarray(prompt))
        d = prop.propose([DraftRequest(0, np.asarray(prompt, dtype=np.int32), len(prompt))], [K])
        assert prop.slots[0].step_mode == expected and int(d.num_tokens[0]) > 0


def test_registry_builds_it_from_a_config(target, draft_dirs):
    cfg = SpecConfig.from_dict({"method": "draft_model", "model": str(draft_dirs["same"]), "num_speculative_tokens": 3})
    prop = build_proposer(cfg, MAX_LEN, target=target)
    assert isinstance(prop, DraftModelProposer) and prop.mode == "same" and prop.draft.dtype == torch.float32
    with pytest.raises(UsageError, match="needs the target"):
        build_proposer(cfg, MAX_LEN)


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("draft_name,mode", [("same", None), ("byte", "auto"), ("byte", "tli"), ("byte", "text")])
def test_greedy_with_draft_equals_greedy_plain(target, drafts, greedy_cases, draft_name, mode):
    prop = make_proposer(target, drafts[draft_name], mode)
    spec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K)
    drafted = accepted = multi = 0
    modes = []
    record = prop._step_mode
    prop._step_mode = lambda s, want: modes.append(record(s, want)) or modes[-1]
    for prompt, expected in greedy_cases:
        res = spec.generate(prompt, SamplingParams(max_new_tokens=NEW))
        assert res.token_ids == expected, prompt
        s = res.stats
        assert len(res.token_ids) == 1 + res.num_steps + s.num_accepted_tokens
        drafted += s.num_draft_tokens
        accepted += s.num_accepted_tokens
        multi += sum(s.num_accepted_tokens_per_pos[1:])
    rate = accepted / drafted
    assert rate > 0.3 and multi > 0, rate  # drafts are accepted, runs of several too
    if draft_name == "same":
        assert rate > 0.5
    # auto: these two tokenizers cut the text alike (merges are rare), so the intersection is used
    assert set(modes) == {"same" if draft_name == "same" else mode if mode != "auto" else "tli"}


def test_draft_cache_is_rolled_back_and_never_reprefilled(target, drafts, greedy_cases):
    prop = make_proposer(target, drafts["same"])
    fed = []
    spec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K)
    prompt, expected = greedy_cases[0]
    spec.start(prompt, SamplingParams(max_new_tokens=NEW))  # creates slot 0
    runner = prop.slots[0].runner
    run = runner.run
    runner.run = lambda tokens, *a, **kw: (fed.append(tokens.shape[1]), run(tokens, *a, **kw))[1]
    st = spec.start(prompt, SamplingParams(max_new_tokens=NEW))
    while st.finish is None:
        spec.step(st)
        s = prop.slots[0]
        # after a step the cache holds the context it last read plus the accepted drafts it fed, no more
        assert runner.length <= s.base + s.num_fed_drafts and runner.length >= s.base
        assert np.array_equal(s.fed[:runner.length], np.asarray(st.ctx[0, :runner.length], dtype=np.int64))
    res = spec.finish(st)
    assert res.token_ids == expected
    # fed: the prompt was read by the first start (in its prefill) and stays in the cache: the second
    # start re-feeds only its last token (for fresh logits); then per step the new tokens and the
    # drafts one by one
    assert fed[0] == 1 and all(n <= 2 for n in fed[1:])  # d_k (never fed) + bonus at most
    assert sum(fed) <= len(prompt) + len(expected) + res.stats.num_draft_tokens
    # the rolled-back cache equals a fresh prefill of the same tokens
    L = runner.length
    fresh = TargetRunner(drafts["same"].model, MAX_LEN)
    fresh.forward(torch.from_numpy(prop.slots[0].fed[:L])[None])
    torch.testing.assert_close(runner.cache.k[:, :, :, :L], fresh.cache.k[:, :, :, :L], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner.cache.v[:, :, :, :L], fresh.cache.v[:, :, :, :L], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("same_prompt", [False, True])
def test_interleaved_requests_keep_their_own_draft_cache(target, drafts, greedy_cases, same_prompt):
    """Two requests stepped in turn (as the server does: a runner and a proposer slot each)."""
    prop = make_proposer(target, drafts["byte"])
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K)
    cases = [greedy_cases[2], greedy_cases[2 if same_prompt else 3]]
    states = [dec.start(p, SamplingParams(max_new_tokens=NEW), runner=TargetRunner(target.model, MAX_LEN), slot=i)
              for i, (p, _) in enumerate(cases)]
    read = [prop.slots[i].runner.length for i in (0, 1)]  # each slot read its prompt in the prefill
    fed = {0: [], 1: []}
    for i in (0, 1):
        r = prop.slots[i].runner
        r.run = (lambda f, log: lambda tokens, *a, **kw: (log.append(tokens.shape[1]), f(tokens, *a, **kw))[1])(
            r.run, fed[i])
    while any(st.finish is None for st in states):
        for st in states:
            if st.finish is None:
                dec.step(st)
    assert [dec.finish(st).token_ids for st in states] == [e for _, e in cases]
    for i, (p, _) in enumerate(cases):  # each slot read its prompt once, then only new tokens and drafts
        assert read[i] > len(p) // 2 and all(n <= 2 for n in fed[i]), (i, read[i], fed[i][:3])


def test_on_verified_rolls_back_in_place(target, drafts):
    prop = make_proposer(target, drafts["byte"], "tli")
    prompt = random_text_prompts(1, seed=5)[0]
    prop.start_request(0, np.asarray(prompt))
    d = prop.propose([DraftRequest(0, np.asarray(prompt + [0] * 8, dtype=np.int32), len(prompt))], [K])
    s = prop.slots[0]
    n = int(d.num_tokens[0])
    assert n == K and d.probs is None and s.runner.length == s.base + K - 1
    drafts_ = d.token_ids[0, :n].tolist()
    base = s.base
    prop.on_verified(0, 1, [drafts_[0], 9])  # first draft accepted, then a recovered token
    assert s.runner.length == base + 1  # the accepted draft it fed is kept, the rejected ones dropped
    prop.on_verified(0, 0, [9])  # a step it drafted nothing for: nothing of its own to roll back
    assert s.runner.length == base + 1


def test_prefix_shared_with_an_earlier_request_is_reused(target, drafts, greedy_cases):
    prop = make_proposer(target, drafts["byte"], "tli")
    spec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K)
    prompt, expected = greedy_cases[1]
    spec.generate(prompt, SamplingParams(max_new_tokens=NEW))
    fed = []
    runner = prop.slots[0].runner
    run = runner.run
    runner.run = lambda tokens, *a, **kw: (fed.append(tokens.shape[1]), run(tokens, *a, **kw))[1]
    assert spec.generate(prompt, SamplingParams(max_new_tokens=NEW)).token_ids == expected
    assert fed[0] < len(prompt)  # the draft kept the prompt's KV from the first request


# --------------------------------------------------------------------------- sampling


def test_sampling_keeps_the_target_distribution(target, drafts):
    """Sampled drafts from the mapped (tli) draft, with q moved onto target ids: tokens 2 and 3 emitted
    are distributed exactly as plain sampling's (arXiv 2211.17192). With max_new_tokens 4 and k 2, the
    first step verifies 2 drafts: token 2 is an accepted draft or a recovered token, token 3 an accepted
    draft, a recovered or a bonus token. The reference is exact (prefixes enumerated); the threshold is
    the 99.9% quantile of the TV a correct sampler shows with as many samples."""
    temperature, N = 0.3, 1000
    prop = make_proposer(target, drafts["byte"], "tli", k=2)
    params = SamplingParams(max_new_tokens=4, temperature=temperature)
    prop.set_sampling(0, SamplingParams(temperature=DRAFT_T))  # q far enough from p that recovered tokens matter
    spec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, 2)
    prompt = random_text_prompts(1, seed=11)[0]
    (_, m2, m3), dropped = exact_marginals(target.model, prompt, temperature, depth=3, prune=1e-5)
    assert dropped < 0.01, dropped
    sec, third, drafted, accepted = emitted_histograms(spec, prompt, params, N, target.model.args.vocab_size)
    assert 0.2 < accepted / drafted < 0.95, accepted / drafted  # accepted and recovered tokens both occur
    for emp, exact in ((sec, m2), (third, m3)):
        tv = 0.5 * float((emp.double() - exact).abs().sum())
        assert tv < null_tv_quantile(exact, N) + dropped, tv


def test_sampled_draft_returns_q_on_target_ids(target, drafts):
    """q of the first draft = the draft's distribution over the intersection, moved onto target ids."""
    draft = drafts["byte"]
    prop = make_proposer(target, draft, "tli")
    prop.temperature = 0.8  # the proposer-wide default, for slots without set_sampling
    prompt = random_text_prompts(1, seed=3)[0]
    prop.start_request(0, np.asarray(prompt))
    d = prop.propose([DraftRequest(0, np.asarray(prompt, dtype=np.int32), len(prompt))], [K])
    q = d.probs
    assert q is not None and q.shape == (1, K, target.model.args.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(1, K))
    assert all(q[0, i, t] > 0 for i, t in enumerate(d.token_ids[0].tolist()))  # drawn where q has mass
    # the reference, built by hand: the draft reads the prompt's text, merged/non-ASCII tokens are dropped
    btok, tvocab = draft.tokenizer, target.tokenizer.get_vocab()
    u2b = {c: b for b, c in B2U.items()}
    text = target.tokenizer.decode(prompt)
    logits = TargetRunner(draft.model, 64).forward(torch.tensor([btok.encode(text, add_special_tokens=False)]))[0, -1]
    expected = torch.zeros(target.model.args.vocab_size)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for tok, j in btok.get_vocab().items():
        t = tok if tok in BYTE_SPECIALS + EXTRAS else (chr(u2b[tok]) if len(tok) == 1 and u2b[tok] < 128 else None)
        keep[j] = t is not None
    p = torch.softmax(logits.masked_fill(~keep, float("-inf")) / 0.8, -1)
    for tok, j in btok.get_vocab().items():
        if keep[j]:
            t = tok if tok in BYTE_SPECIALS + EXTRAS else chr(u2b[tok])
            expected[tvocab[t]] += p[j]
    torch.testing.assert_close(q[0, 0], expected, atol=1e-5, rtol=1e-4)

    # same tokenizer: q is the draft's own processed distribution, ids untouched
    same = make_proposer(target, drafts["same"])
    same.set_sampling(0, SamplingParams(temperature=0.8, top_k=20))
    same.start_request(0, np.asarray(prompt))
    d = same.propose([DraftRequest(0, np.asarray(prompt, dtype=np.int32), len(prompt))], [1])
    logits = TargetRunner(drafts["same"].model, 64).forward(torch.tensor([prompt]))[0, -1]
    torch.testing.assert_close(d.probs[0, 0], logits_to_probs(logits, 0.8, 20))
    assert d.probs[0, 0, int(d.token_ids[0, 0])] > 0 and int((d.probs[0, 0] > 0).sum()) == 20


def test_text_mode_is_deterministic_from_the_target_view(target, drafts):
    prop = make_proposer(target, drafts["byte"], "text")
    prop.temperature = 0.8
    prompt = random_text_prompts(1, seed=4)[0]
    prop.start_request(0, np.asarray(prompt))
    d = prop.propose([DraftRequest(0, np.asarray(prompt, dtype=np.int32), len(prompt))], [K])
    assert d.probs is None and 0 < int(d.num_tokens[0]) <= K


# --------------------------------------------------------------------------- wrong pair


def test_a_map_for_another_pair_is_refused(target, drafts, tmp_path):
    good = build_vocab_map(drafts["byte"].tokenizer, target.tokenizer)
    path = good.save(tmp_path / "map.safetensors")
    assert make_proposer(target, drafts["byte"], vocab_map=str(path)).mode == "auto"
    swapped = build_vocab_map(target.tokenizer, drafts["byte"].tokenizer).save(tmp_path / "swapped.json")
    with pytest.raises(DataError, match="opposite direction") as e:
        make_proposer(target, drafts["byte"], vocab_map=str(swapped))
    assert "\n" not in str(e.value) and "build-vocab-map" in str(e.value)
    # a map between two other tokenizers (byte -> byte): the target's fingerprint does not match
    other = build_vocab_map(byte_level_tokenizer(), byte_level_tokenizer())
    with pytest.raises(DataError, match="target tokenizer differs"):
        make_proposer(target, drafts["byte"], vocab_map=other)


def test_the_config_key_vocab_map_carries_a_map_file(target, drafts, tmp_path):
    """What `--speculative-config '{..., "vocab_map": FILE}'` passes: the file build-vocab-map wrote is
    used (and checked); a missing file or another method is a one-line config error; vLLM never sees it."""
    from specctl.errors import ConfigError
    from specctl.vllm_compat import vllm_speculative_config

    path = build_vocab_map(drafts["byte"].tokenizer, target.tokenizer).save(tmp_path / "map.safetensors")
    base = {"method": "draft_model", "model": "unused", "num_speculative_tokens": K}
    cfg = SpecConfig.from_dict({**base, "vocab_map": str(path)})
    p = DraftModelProposer(cfg, target=target, max_model_len=MAX_LEN, draft=drafts["byte"])
    assert p.mode == "auto" and p.vocab_map.draft_vocab_size > 0
    swapped = build_vocab_map(target.tokenizer, drafts["byte"].tokenizer).save(tmp_path / "swapped.json")
    with pytest.raises(DataError, match="opposite direction"):
        DraftModelProposer(SpecConfig.from_dict({**base, "vocab_map": str(swapped)}), target=target,
                           max_model_len=MAX_LEN, draft=drafts["byte"])
    with pytest.raises(ConfigError, match="is not a file"):
        SpecConfig.from_dict({**base, "vocab_map": str(tmp_path / "nope.safetensors")})
    with pytest.raises(ConfigError, match="drafts with none"):
        SpecConfig.from_dict({"method": "ngram", "vocab_map": str(path)})
    assert "vocab_map" not in vllm_speculative_config(cfg)
    # a draft with the target's own tokenizer needs no map, but a wrong one given is still refused
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a map")
    with pytest.raises(DataError):
        DraftModelProposer(SpecConfig.from_dict({**base, "vocab_map": str(junk)}), target=target,
                           max_model_len=MAX_LEN, draft=drafts["same"])


@pytest.mark.parametrize("draft_name", ["same", "byte"])
def test_batched_greedy_equals_plain(target, drafts, greedy_cases, run_batched, draft_name):
    """Requests decoding together, each with its own draft cache, give their plain output (identical
    requests too: the decoder names each request's slot)."""
    cases = greedy_cases[:8] + greedy_cases[:2]
    prop = make_proposer(target, drafts[draft_name])
    calls = []
    ragged = prop.draft.model.forward_ragged
    prop.draft.model.forward_ragged = lambda tokens, segs, **kw: (calls.append(len(segs)), ragged(tokens, segs, **kw))[1]
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K)
    got = run_batched(dec, [p for p, _ in cases], [SamplingParams(max_new_tokens=NEW)] * len(cases))
    assert [r.token_ids for r in got] == [o for _, o in cases]
    assert sum(r.stats.num_accepted_tokens for r in got) > 0
    assert calls and max(calls) > 1  # the requests' drafts came out of shared draft forwards


def test_the_draft_reads_a_prompt_chunk_by_chunk_with_the_target(target, drafts, greedy_cases, run_batched):
    """With chunked prefill, the draft model reads each prompt along with the target's chunks: no
    draft forward carries more than a chunk (a whole prompt's draft prefill would stall the batch)."""
    chunk = 4
    cases = greedy_cases[:6]
    assert max(len(p) for p, _ in cases) > 2 * chunk
    prop = make_proposer(target, drafts["same"])
    sizes = []
    forward = prop.draft.model.forward
    prop.draft.model.forward = lambda tokens, *a, **kw: (sizes.append(tokens.shape[1]), forward(tokens, *a, **kw))[1]
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K)
    got = run_batched(dec, [p for p, _ in cases], [SamplingParams(max_new_tokens=NEW)] * len(cases),
                      max_num_batched_tokens=chunk)
    assert [r.token_ids for r in got] == [o for _, o in cases]
    assert sizes and max(sizes) <= chunk


def test_a_draft_that_skipped_the_prompt_catches_up_a_chunk_per_step(target, drafts, greedy_cases, monkeypatch):
    """A request admitted while its batch was not drafting left the prompt unread: its draft reads it
    CATCH_UP tokens per step, without drafting, then drafts as usual; output stays plain."""
    import specctl.runtime.proposers.draft_model as dm

    monkeypatch.setattr(dm, "CATCH_UP", 3)
    prop = make_proposer(target, drafts["same"])
    sizes = []
    forward = prop.draft.model.forward
    prop.draft.model.forward = lambda tokens, *a, **kw: (sizes.append(tokens.shape[1]), forward(tokens, *a, **kw))[1]
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K)
    prompt, expected = next((p, o) for p, o in greedy_cases if len(p) > 9)
    st = dec.begin(prompt, SamplingParams(max_new_tokens=NEW))
    dec.prefilled(st, len(prompt), st.runner.run(dec.prefill_tokens(st, len(prompt)), logits="last"),
                  read_prompt=False)
    assert sizes == [] and prop.slots[0].runner.length == 0  # the prompt was not read
    while st.finish is None:
        dec.step(st)
    assert dec.finish(st).token_ids == expected
    assert max(sizes) <= 3  # read in chunks of CATCH_UP
    assert st.stats.num_draft_tokens > 0  # then it drafted


def test_a_request_joining_a_batch_where_the_draft_would_not_pay_leaves_its_prompt_unread(target, drafts):
    """The draft model's cost hint is its weights over the target's. With the batch's forwards
    measured costly per row, the decoder expects a draft model of that cost not to draft in a batch
    of 8, so a request joining it does not have its draft read the prompt (it would catch up if
    drafting turned on); alone, or with a free draft, it reads."""
    prop = make_proposer(target, drafts["same"])
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in {id(t): t for t in [*m.parameters(), *m.buffers()]}.values())  # noqa: E731
    assert prop.draft_cost == pytest.approx(nbytes(prop.draft.model) / nbytes(target.model))
    prop.draft_cost = 0.33
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K, adaptive=True)
    assert dec._reads_prompt(8)  # nothing measured yet: it drafts, so it reads
    dec._costs.update({t: 0.1 + 0.004 * t for t in (1, 8, 40, 257)})
    assert not dec._reads_prompt(8) and dec._reads_prompt(1)
    prop.draft_cost = 0.0
    assert dec._reads_prompt(8)


def test_a_draft_model_that_stopped_paying_does_not_read_the_next_prompt(target, drafts):
    """Alone too: once drafting is measured (its cost per token, the verification's) and the drafts of
    the earlier requests were rejected, a new request's draft does not read the prompt; while they
    were accepted, it does. Unmeasured, it reads (and gets measured)."""
    from specctl.runtime.controller import DRAFT

    prop = make_proposer(target, drafts["same"])
    prop.draft_cost = 0.33  # as a draft a third of its target's size (the tiny one is the target's twin)
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K, adaptive=True)
    assert dec._reads_prompt(1)
    dec._costs.update({1: 0.1, K + 1: 0.104, DRAFT: 0.03})  # a draft token: 0.3 of a plain step
    for _ in range(60):
        dec._pooled.observe(K, K)  # every draft accepted: it pays
    assert dec._reads_prompt(1)
    for _ in range(200):
        dec._pooled.observe(K, 0)  # then every one rejected
    assert not dec._reads_prompt(1)


def test_a_step_the_draft_sits_out_keeps_its_cache(target, drafts, greedy_cases):
    """Steps without a draft (the adaptive controller's first, plain step; drafting switched off) leave
    the draft's cache as it is: the prompt it read in the prefill stays read, so its next draft reads one
    token, not the whole context again (a stale rollback point once threw the prompt away)."""
    prop = make_proposer(target, drafts["same"])
    prop.draft_cost = 0.33  # as a draft a third of its target's size (the tiny one is the target's twin)
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K, adaptive=True)
    prompt, expected = next((p, o) for p, o in greedy_cases if len(p) > 9)
    st = dec.start(prompt, SamplingParams(max_new_tokens=NEW))
    assert prop.slots[0].runner.length == len(prompt) and prop.backlog(0) == 0  # read in the prefill
    dec.step(st)
    assert st.stats.num_draft_tokens == 0  # a plain step: the controller measures one first
    assert prop.slots[0].runner.length == len(prompt) and prop.backlog(0) == 1  # only the new token is unread
    while st.finish is None:
        dec.step(st)
    assert dec.finish(st).token_ids == expected


@pytest.mark.parametrize("new, reads", [(NEW, True), (2, False)])
def test_a_draft_model_reads_a_prompt_only_where_its_drafts_pay_the_reading_back(target, drafts, greedy_cases, new, reads):
    """Drafting measured to pay (every draft accepted, a draft token a tenth of a plain step) and the draft's
    reading measured at a second for the prompt: over 24 new tokens the drafts save more than that, so the
    prompt is read in the prefill and the request drafts; over 2 they cannot, so the prompt is left unread
    and the request never drafts (catching up later would cost the same reading for fewer tokens). Output
    equals plain either way."""
    from specctl.runtime.controller import DRAFT

    prop = make_proposer(target, drafts["same"])
    prop.draft_cost = 0.33
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K, adaptive=True)
    dec._costs.update({1: 0.1, K + 1: 0.104, DRAFT: 0.01})
    for _ in range(60):
        dec._pooled.observe(K, K)
    prompt, expected = next((p, o) for p, o in greedy_cases if len(p) > 9)
    prop._read_s = 1.0 / len(prompt)  # the whole prompt: a second of the draft's reading
    saving = dec._controller().best_value()  # tokens per plain step: 0.1 s * (1 - 1/v) saved per token
    assert new * 0.1 * (1 - 1 / saving) > 1.0 if reads else 2 * 0.1 < 1.0
    st = dec.start(prompt, SamplingParams(max_new_tokens=new))
    assert (prop.slots[0].runner.length == len(prompt)) == reads and st.undrafted != reads
    while st.finish is None:
        dec.step(st)
    assert dec.finish(st).token_ids == expected[:new]
    assert (st.stats.num_draft_tokens > 0) == reads


@pytest.mark.parametrize("read_s, probes", [(1.0, False), (0.0, True)])
def test_a_switched_off_draft_model_probes_only_where_catching_up_is_cheap(target, drafts, greedy_cases, read_s, probes):
    """A draft model measured not paying, whose request's prompt it left unread: a due probe would first
    read the whole backlog, so it is skipped when that reading (the draft's own measured seconds per
    token) costs more than PROBE_CATCH_UP plain steps, and the draft model never runs; where reading is
    cheap, the probe runs and reads. Output equals plain either way."""
    from specctl.runtime.controller import DRAFT

    prop = make_proposer(target, drafts["same"])
    sizes = []
    forward = prop.draft.model.forward
    prop.draft.model.forward = lambda tokens, *a, **kw: (sizes.append(tokens.shape[1]), forward(tokens, *a, **kw))[1]
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K, adaptive=True)
    dec._costs.update({1: 0.1, K + 1: 0.104, DRAFT: 0.03})
    for _ in range(200):
        dec._pooled.observe(K, 0)  # earlier requests: every draft rejected
    prop._read_s = read_s  # seconds per context token read, as measured
    prompt, expected = next((p, o) for p, o in greedy_cases if len(p) > 9)
    st = dec.begin(prompt, SamplingParams(max_new_tokens=NEW))
    dec.prefilled(st, len(prompt), st.runner.run(dec.prefill_tokens(st, len(prompt)), logits="last"),
                  read_prompt=False)
    while st.finish is None:
        dec.step(st)
    assert probes or prop.catch_up_seconds(0) >= read_s * len(prompt)  # the backlog only grew
    assert dec.finish(st).token_ids == expected
    assert bool(sizes) == probes and (st.stats.num_draft_tokens > 0) == probes


def test_a_draft_gguf_quantization_without_a_gguf_names_the_drafts_keys(tiny_model_dir):
    """It named --model / --quantization, the target's options, for a problem in the draft's config."""
    from specctl.errors import UsageError
    from specctl.runtime.proposers.draft_model import load_draft
    from specctl.runtime.loading import load_model

    cfg = SpecConfig.from_dict({"method": "draft_model", "model": str(tiny_model_dir), "quantization": "gguf"})
    with pytest.raises(UsageError, match="the draft's \"quantization\": \"gguf\"") as e:
        load_draft(cfg, load_model(tiny_model_dir, dtype="float32"))
    assert "--model" not in str(e.value) and "draft's \"model\"" in e.value.fix


@pytest.mark.parametrize("new, reads", [(NEW, True), (2, False)])
def test_in_a_batch_an_unmeasured_draft_reads_a_prompt_only_where_its_size_says_the_reading_pays(
        target, drafts, greedy_cases, new, reads):
    """Eight requests in flight, the draft model's reading and drafting not measured yet. Alone it would read
    the prompt to get measured; in the batch the reading is first weighed, at its size's estimate
    (READ_PRIOR of its cost hint per token), against what its drafts could save over the request's max_tokens
    at the prior's acceptance: before a plain step is measured it reads nothing yet (and the request may still
    draft later); after, it reads where that pays (24 new tokens) and leaves the request undrafted where it
    cannot (2). Output equals plain either way."""
    from specctl.runtime.controller import READ_PRIOR

    prop = make_proposer(target, drafts["same"])
    prop.draft_cost = 0.2
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K, adaptive=True)
    prompt, expected = next((p, o) for p, o in greedy_cases if len(p) > 9)
    st = dec.begin(prompt, SamplingParams(max_new_tokens=new))
    assert prop._read_s is None and not dec._reads_prompt(8, st) and not st.undrafted  # no plain step yet: not now
    assert dec._reads_prompt(1, st)  # alone it would read, to be measured
    dec._costs.update({1: 0.1, K + 1: 0.104})
    c = dec._controller()
    estimate = len(prompt) * READ_PRIOR * 0.2 * 0.1
    assert c.reading_estimate(len(prompt)) == pytest.approx(estimate)
    saved = new * c.plain_step_s(8) * (1 - 1 / c.best_value(8))
    assert (saved > estimate) == reads  # the cases are what they say
    dec.step_batch([], prefills=[(st, len(prompt))], in_flight=8)
    assert (prop.slots[0].runner.length == len(prompt)) == reads and st.undrafted != reads
    while st.finish is None:
        dec.step(st)
    assert dec.finish(st).token_ids == expected[:new]


def test_the_scheduler_tells_the_decoder_every_request_in_flight(target, drafts, greedy_cases):
    """Requests admitted together read their prompts chunk by chunk, one after another: the first one's
    prompt is weighed as a batch of all of them (they will decode together), not as a request alone."""
    from specctl.runtime.scheduler import Request, Scheduler

    prop = make_proposer(target, drafts["same"])
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K, adaptive=True)
    seen, weigh = [], dec._reads_prompt
    dec._reads_prompt = lambda batch, st=None: (seen.append(batch), weigh(batch, st))[1]
    prompts = [p for p, _ in greedy_cases[:3]]
    sched = Scheduler(dec, [TargetRunner(target.model, MAX_LEN) for _ in range(3)], max_num_batched_tokens=4)
    results = sched.run([Request(p, SamplingParams(max_new_tokens=4)) for p in prompts])
    assert seen[0] == 3 and len(results) == 3


@pytest.mark.parametrize("read_s, catches_up", [(1.0, False), (1e-4, True)])
def test_a_draft_that_skipped_a_prompt_catches_up_only_where_the_reading_pays_back(
        target, drafts, greedy_cases, read_s, catches_up):
    """A request whose prompt the draft left unread in the prefill (in a batch, before anything was measured),
    once drafting is measured to pay: its first draft would catch the whole prompt up first, stalling the
    batch, so the decoder weighs that reading as it weighs a prompt in the prefill. A second of reading is
    not paid back over 24 tokens at a batch of 8: the request stays undrafted; a tenth of a millisecond is,
    and it drafts. Output equals plain either way."""
    from specctl.runtime.controller import DRAFT

    prop = make_proposer(target, drafts["same"])
    prop.draft_cost = 0.33
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, K, adaptive=True)
    dec._costs.update({1: 0.1, K + 1: 0.104, DRAFT: 0.01})
    for _ in range(60):
        dec._pooled.observe(K, K)  # every draft accepted: drafting pays at a batch of 8 too
    prompt, expected = next((p, o) for p, o in greedy_cases if len(p) > 17)
    st = dec.begin(prompt, SamplingParams(max_new_tokens=NEW))
    dec.prefilled(st, len(prompt), st.runner.run(dec.prefill_tokens(st, len(prompt)), logits="last"),
                  read_prompt=False)
    prop._read_s = read_s / len(prompt)
    assert st.controller.best_len(8) > 0 and prop.backlog(0) >= len(prompt)
    k = dec._draft_len(st, None, 8)
    assert (k > 0) == catches_up and st.undrafted != catches_up
    while st.finish is None:
        dec.step(st)
    assert dec.finish(st).token_ids == expected
    assert (st.stats.num_draft_tokens > 0) == catches_up
