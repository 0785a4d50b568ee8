"""``ds-seqpar plan``: the cost model of sequence-parallel training and the command over it.

    hardware.py     GPU profiles (profiles/*.json: datasheet peaks with their sources, assumed efficiencies)
    model_shape.py  the numbers of a model, from its Hugging Face config
    flops.py        FLOPs per token per layer kind (softmax with causal / window work, linear / SSD, MLP, MoE, head)
    comm_model.py   alpha-beta times of all-to-all, ring send/recv with overlap, all-gather / reduce-scatter
    memory.py       static memory by ZeRO stage and bytes per token per phase, with and without the features
    search.py       every configuration, checked as the main job checks it, predicted and ranked
    ds_json.py      the chosen configuration as a DeepSpeed JSON
    main.py         the command line
    calibrate.py    --calibrate: this machine's alpha/beta (gloo ranks) and kernel rates
    calibrate_report.py  reports/plan_cpu.md: the calibrated predictions beside what reports/ measured

Bytes per rank come from strategies/closed_form.py (closed_form_by_kind, transient_bytes), the
same oracle the distributed tests hold the strategies to. docs/plan.md has the model and how its
predictions compare with published and measured results.
"""
