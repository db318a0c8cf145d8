"""The wheel carries the project's pipeline.yaml as stages/pipeline.yaml (stages/engine/paths.py reads it
there when installed); the checkout keeps the one source, at its top. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithPipeline(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "stages" / "pipeline.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(__file__).resolve().parent / "pipeline.yaml", target)


setup(cmdclass={"build_py": BuildPyWithPipeline})
