"""Package layout that ``pyproject.toml`` cannot express (everything else is declared there).

``pl_fedsparse`` and its subpackages are discovered as usual; two top-level folders of the repository, which the
project layout keeps where they are, are installed inside the package so that they exist after a regular
(non-editable) ``pip install``:

* ``configs/*.yaml`` as ``pl_fedsparse/configs/`` (package data): the shipped configs, run by name with
  ``pl-fed fit --config NAME.yaml`` from any directory (:mod:`pl_fedsparse.shipped`);
* ``callbacks/`` as the package ``pl_fedsparse.examples``: the extension examples, which the shipped configs name as
  ``pl_fedsparse.examples.<file>.<Class>``.

An editable install maps both folders the same way (the repository's files are used in place). ``py.typed``
marks the package as typed (PEP 561): a user's type checker reads its annotations.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["pl_fedsparse", "pl_fedsparse.*"]), "pl_fedsparse.configs",
              "pl_fedsparse.examples"],
    package_dir={"pl_fedsparse.configs": "configs", "pl_fedsparse.examples": "callbacks"},
    package_data={"pl_fedsparse": ["py.typed"], "pl_fedsparse.configs": ["*.yaml"]},
)
