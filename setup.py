"""Build step that installs the one-line `fp8comm-autoload.pth` into site-packages (metadata: pyproject.toml).

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

import os

from setuptools import setup
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


setup(cmdclass={"build_py": BuildPyWithAutoload})
