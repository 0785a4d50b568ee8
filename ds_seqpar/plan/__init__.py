"""``ds-seqpar plan``: the cost model of sequence-parallel training and the command over it.

    cost/           the cost model, the one place that prices (model shape, mask, layout, candidate):
                    pairs per rank, bytes, FLOPs, memory by phase, time (a core module: it imports the
                    core only, so the runtime may price with it)
    hardware.py     GPU profiles (profiles/*.json: datasheet peaks with their sources, assumed efficiencies)
    model_shape.py  the numbers of a model, from its Hugging Face config
    search.py       every configuration, checked as the main job checks it, predicted and ranked
    ds_json.py      the chosen configuration as a DeepSpeed JSON
    main.py         the command line; inputs.py: the model and documents it is asked for
    measure.py      --calibrate's timing here: gloo alpha/beta, kernel rates, kernel calls, and their fits
    calibrate.py    --calibrate's models: the bench's rows (report/rows.py) predicted with those numbers
    calibrate_report.py  --calibrate: measure, predict, write reports/plan_cpu as rows (report/render.py)

Bytes per rank come from strategies/closed_form.py, the same oracle the distributed tests hold the
strategies to. docs/plan.md has the model and how its predictions compare with published and
measured results.
"""
