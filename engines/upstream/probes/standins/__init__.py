"""Stand-ins for GPU-only packages that Miles' DeepSeek-V4 model needs at BUILD time (module structure), used by
model_probe.py on CPU or the meta device. Never imported by v4rl's library code: the folder is put first on the
probe subprocess' sys.path. See transformer_engine/__init__.py for why each keeps names and values.
"""
