"""Measurements that the benchmark programs (pretrain/benchmarks/, `tools/benchmark.py`) and
the GPU acceptance run (pretrain/gpucheck/, `make gpu-check`) both take. Below both: this
package imports neither of them nor pretrain.cli, and the GPU check imports the benchmarks'
code only from here.

    peer_models.py    our model and its peers (transformers, litgpt) at one set of weights
    peer_race.py      their training steps in paired rounds (`race`): `benchmark.py peers`,
                      the GPU check's peers stages
    rope_variants.py  one model per (rope_theta, rope fraction), one set of weights:
                      `benchmark.py model`, the GPU check's science stage
    measured_run.py   a config made into a measured training run, and its random tokens:
                      `benchmark.py train` and `checkpoint`, the GPU check's training stages
"""
