"""The zoo sweep (tests/hf_zoo.py) on the shared pool: every decoder-only causal LM of the installed
transformers under every softmax strategy at P=2 trains exactly or is refused by name, the same on
both ranks of each sequence group; never a silent mismatch. docs/models.md is this sweep's page."""
from ..hf_zoo import STRATEGIES, causal_lm_types, merged, sweep

# architectures whose masks this wave made exact; they must stay exact under every strategy (Llama 4's own
# row keeps its NoPE layers, whose attention temperature tuning is refused by name; the variant row without it
# keeps the chunked and NoPE layers exact)
MUST_BE_EXACT = {"llama", "mistral", "mixtral", "gemma2", "gemma3_text", "cohere2", "qwen2",
                 "llama4_text, attn_temperature_tuning=False", "gpt_oss", "starcoder2", "olmo3", "exaone4", "ministral"}

# hybrids whose linear-attention / SSM / conv layers this wave made sequence-parallel
HYBRIDS_EXACT = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "bailing_hybrid",
                 "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2", "mamba2", "minimax", "lfm3"}

def test_every_causal_lm_is_exact_or_refused_by_name(pool):
    results = pool.run(sweep, causal_lm_types())
    for a, b in ((0, 1), (2, 3)):                        # the two ranks of each sequence group
        assert [(mt, r) for mt, r, _ in results[a]] == [(mt, r) for mt, r, _ in results[b]] or all(
            {s: o[0] for s, o in ra.items()} == {s: o[0] for s, o in rb.items()}
            for (_, ra, _), (_, rb, _) in zip(results[a], results[b])), "ranks of one group disagree"
    rows = merged(results)
    assert len(rows) == len(causal_lm_types())
    mismatches = [(mt, s, o[1]) for mt, r, _ in rows for s, o in r.items() if o[0] == "mismatch"]
    assert not mismatches, f"silently wrong under sequence parallelism: {mismatches}"
    outcome = {mt: r for mt, r, _ in rows}
    for mt in HYBRIDS_EXACT & set(outcome):                  # docs/hybrids.md: state passing needs runs of tokens
        assert all(outcome[mt][s][0] == "exact" for s in STRATEGIES if s != "striped"), (mt, outcome[mt])
        assert outcome[mt]["striped"][0] == "refused" and "striped" in outcome[mt]["striped"][1], (mt, outcome[mt])
    for mt in MUST_BE_EXACT & set(outcome):
        assert all(outcome[mt][s][0] == "exact" for s in STRATEGIES), (mt, outcome[mt])
    for mt, r, _ in rows:
        for s, (kind, detail) in r.items():
            if kind == "refused":
                assert "cannot be exact under sequence parallelism" in detail or "ds_seqpar" in detail, (mt, s, detail)
