"""Ship the top-level ``cuda/`` sources inside the package as ``vllm_tfm/kernels/cuda/``.

Everything else is declared in pyproject.toml. The kernels are compiled at load time by NVRTC,
so a wheel must carry the ``.cu``/``.cuh`` text; the repository keeps them in ``cuda/``
(DESIGN.md section 3), and ``vllm_tfm.kernels.loader.cuda_source_dir`` looks in the package copy
first and in the checkout's ``cuda/`` second.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithCuda(build_py):
    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "vllm_tfm" / "kernels" / "cuda"
        dest.mkdir(parents=True, exist_ok=True)
        for src in sorted((ROOT / "cuda").glob("*.cu*")):
            self.copy_file(str(src), str(dest / src.name))


setup(cmdclass={"build_py": BuildPyWithCuda})
