"""The generate sweep: decoder families of the installed transformers (tests/zoo/decoders.py's tiny configs),
each applied at P=2 (zigzag) and generating 6 greedy tokens from a 27-token prompt: exact (tokens equal
the unsharded model's float64 and float32 runs, every step's scores within the bound the float32 run's
own error sets) or refused by name. ``python -m tests.zoo.generate`` starts 2 local ranks and prints
the table docs/generation.md quotes (about a minute and a half on 2 busy cores); not part of the suite,
which tests the families with a window, softcap, sinks and MLA in tests/dist/test_generate.py."""
import torch

FAMILIES = ("llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "cohere", "cohere2", "qwen2", "qwen3",
            "qwen3_moe", "starcoder2", "olmo2", "olmo3", "exaone4", "ministral", "gpt_oss", "phi3", "granite", "glm4",
            "smollm3", "llama4_text", "deepseek_v3", "hunyuan_v1_dense", "seed_oss", "apertus", "arcee")


def _build(cfg, dtype, state=None):
    import transformers as T
    torch.manual_seed(0)
    try:           # eager attention: the reference applies softcap and sinks; eager experts run in float64
        model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    except (TypeError, ValueError):
        model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype).eval()


def verdict(family, sp) -> str:
    from ds_seqpar.hf import UnsupportedModelError, apply_sequence_parallel

    from .decoders import tiny_config
    from ..reference import assert_derived_close
    cfg = tiny_config(family)
    state = _build(cfg, torch.float32).state_dict()
    prompt = torch.randint(3, 100, (1, 27), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True, pad_token_id=0)
    with torch.no_grad():
        ref64 = _build(cfg, torch.float64, state).generate(input_ids=prompt, **kw)
        ref32 = _build(cfg, torch.float32, state).generate(input_ids=prompt, **kw)
        if not torch.equal(ref64.sequences, ref32.sequences):
            return "no verdict: the unsharded float32 and float64 runs pick different tokens"
        try:
            got = apply_sequence_parallel(_build(cfg, torch.float32, state), sp).generate(input_ids=prompt, **kw)
        except UnsupportedModelError as err:
            return f"refused: {err}"
    if not torch.equal(got.sequences, ref64.sequences):
        return "WRONG: tokens differ"
    for i, (s, r64, r32) in enumerate(zip(got.scores, ref64.scores, ref32.scores)):
        assert_derived_close(f"{family} step {i}", s, r64, r32)
    return "exact"


def sweep(families=FAMILIES):
    from ds_seqpar import SequenceParallel
    sp = SequenceParallel({"strategy": "zigzag", "size": 2})
    return {f: verdict(f, sp) for f in families}


def main() -> None:
    from ds_seqpar.launch.rankpool import RankPool
    pool = RankPool(2, timeout_s=900.0, threads_per_rank=1).start()
    try:
        results = pool.run(sweep, timeout=900.0)
    finally:
        pool.close()
    assert results[0] == results[1], "the ranks disagree"
    print("| model type | generate at P=2 (zigzag) |\n|---|---|")
    for family, v in results[0].items():
        print(f"| {family} | {v} |")


if __name__ == "__main__":
    main()
