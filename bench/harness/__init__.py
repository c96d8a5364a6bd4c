"""The quality benchmark's harness (bench/quality.py is its command line, bench/quality_job.py its DeepSpeed job),
in the order a run goes through it:

- `instrument`: what every arm shares (`Settings`), the recipes and presets, the choosing flags' candidate lists;
- `data`: the train / validation / held-out files of a run (`prepare_data` -> `PreparedData`);
- `arms`: the typed `Arm` and `Analysis` (exactly the spec's JSON), and how settings are named;
- `builders`: one builder per method and the ablations, `build_arms`;
- `launch`: the job's spec and its one deepspeed launch;
- `job`: what runs inside that job (features, clustering, training and evaluating each arm);
- `summary`: the finished arms' figures per setting, paired with their partners (statistics included);
- `gate`, `goals`, `choice`, `ablations`: the declared rules, each returning plain data;
- `tables`, `report`: the markdown, the plot and the results JSON (rendering only).
"""
