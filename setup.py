"""Build steps (metadata: pyproject.toml): the 4-bit CPU kernels as a native extension, and the one-line
`fp8comm-autoload.pth` in site-packages.

The extension `fp8comm.quant._fp4_cpu` is fp4_cpu.c compiled by the installer's C compiler, loaded with ctypes by
fp8comm/quant/fp4_native.py (no Python API inside). It is optional: without a compiler the install still succeeds
and the CPU wire uses the (slower, bit-identical) compiled or reference path with one warning. Its flags run on any
machine of the platform (no -march=native; the C file carries per-CPU clones), and the library records the sha256
of its source, so a stale in-place build is refused rather than loaded.

The line imports `_fp8comm_autoload` at interpreter start, which makes `deepspeed.initialize` honour the "fp8_comm"
section without any import in the user's script (docs/deepspeed.md, "The flag alone"). The file must land at the
root of site-packages, where `site` reads .pth files, so it is a build_py output (the wheel's purelib root), not
data_files (which land under the prefix). Its name sorts after `__editable__.fp8comm-*.pth`: in an editable
install that file puts up the finder through which `_fp8comm_autoload` is imported.

Editable installs (PEP 660): setuptools runs build_py with editable_mode=True into a throw-away build_lib and then
ships only its own .pth and finder, so the file is written into the unpacked editable wheel instead: the `install`
command's install_lib, which setuptools' editable_wheel points at that directory (setuptools >= 64).
"""

from __future__ import annotations

import hashlib
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import SetupError

PTH_NAME = "fp8comm-autoload.pth"
PTH_LINE = "import _fp8comm_autoload\n"  # `site` executes .pth lines that start with "import"


class BuildPyWithAutoload(build_py):
    """build_py, plus fp8comm-autoload.pth at the root of the wheel (regular builds) or of the editable wheel."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            target = self.get_finalized_command("install").install_lib
            if not any(name.endswith(".dist-info") for name in os.listdir(target)):
                # Not setuptools' unpacked editable wheel: writing there would not reach site-packages.
                raise SetupError(
                    f"fp8comm: cannot place {PTH_NAME} in this editable build ({target} is not the unpacked "
                    "editable wheel; setuptools changed how editable wheels are built). Install without -e, or "
                    "run with `import fp8comm.integrations.deepspeed` in the training script."
                )
        else:
            target = self.build_lib
        self.mkpath(target)
        with open(os.path.join(target, PTH_NAME), "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs


FP4_SRC = "fp8comm/quant/fp4_cpu.c"
# Kept equal to fp4_native.CFLAGS (the opt-in build at first use): -ffp-contract=off and no fast-math keep every
# fp32 operation rounding as torch's does.
FP4_CFLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math"]


class BuildExtOptional(build_ext):
    """build_ext with the source's sha256 compiled in; a failed build is reported, never fatal (optional=True)."""

    def build_extension(self, ext) -> None:
        sha = hashlib.sha256(open(FP4_SRC, "rb").read()).hexdigest()
        ext.define_macros = [*ext.define_macros, ("FP8COMM_SRC_SHA", f'"{sha}"')]
        super().build_extension(ext)


setup(
    cmdclass={"build_py": BuildPyWithAutoload, "build_ext": BuildExtOptional},
    ext_modules=[
        Extension(
            "fp8comm.quant._fp4_cpu",
            [FP4_SRC],
            extra_compile_args=FP4_CFLAGS,
            libraries=["m"],
            optional=True,
        )
    ],
)
