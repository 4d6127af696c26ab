"""One typed definition of a run and the named presets built from it.

  spec.py      the RunPreset dataclasses (model, data, algorithm, evaluation, engines, layout sections)
  runs.py      the named run presets (the seed's, Miles' launcher presets, tiny-cpu), overrides, the planner entry
  models.py    the tiny-cpu and Flash model configs
  flash.py     DeepSeek-V4-Flash's HF config
  backends.py  which engines a preset's steps run on (embedded or Miles)
  launch.py    cluster launch plans (what runs where) as JSON

    from engines.presets.runs import get_run_preset, preflight_plan
"""
