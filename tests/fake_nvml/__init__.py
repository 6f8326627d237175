"""A fake NVIDIA driver for tests: ``fake_nvml.c`` compiled into ``libnvidia-ml.so.1`` and driven by a
scenario file (see ``README.md`` here); :mod:`.build` compiles it and writes scenarios."""
