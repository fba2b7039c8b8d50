"""``pl-fed``: the LightningCLI front end.

``pl-fed fit|validate|test --config X.yaml [--section.key value ...]``. Sections: ``trainer`` (the
:class:`~pl_fedsparse.loop.FederatedLoop`, including ``trainer.callbacks`` by ``class_path``), ``model`` (the
:class:`~pl_fedsparse.module.FederatedModule` and its ``backbone``), ``data`` (the
:class:`~pl_fedsparse.data.FederatedDataModule`), plus ``--seed_everything`` and ``--ckpt_path``.

Differences from a stock ``LightningCLI`` (see DESIGN.md §5): the "trainer" is a plain class, so it is registered
with ``add_class_arguments`` and built by :meth:`FedCLI.instantiate_trainer`; the configuration is written to the
run directory by the loop (``config.yaml``) instead of Lightning's ``SaveConfigCallback``; user errors end in one
line, never a traceback.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.loop import FederatedLoop
from pl_fedsparse.module import FederatedModule

__all__ = ["FedCLI", "main"]


class _OneLineErrors(LightningArgumentParser):
    """Report parse errors in one line (``error: ...``), exit status 2, no usage dump."""

    def error(self, message: str, ex: Exception | None = None) -> Any:  # type: ignore[override]
        if not self.exit_on_error:
            return super().error(message, ex)
        lines = [s.strip() for s in str(message).splitlines() if s.strip()]
        # jsonargparse nests the useful part last ("Parser key 'x': ... - Expected ...")
        text = " ".join(lines)
        if len(text) > 400:
            text = text[:400] + " ..."
        sys.stderr.write(f"error: {text} (see `pl-fed {self.prog.split()[-1]} --help`)\n")
        sys.exit(2)


class FedCLI(LightningCLI):
    """LightningCLI whose trainer is a :class:`~pl_fedsparse.loop.FederatedLoop`."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", FederatedModule)
        kwargs.setdefault("datamodule_class", FederatedDataModule)
        kwargs.setdefault("trainer_class", FederatedLoop)  # type: ignore[arg-type]
        kwargs.setdefault("save_config_callback", None)
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("parser_class", _OneLineErrors)
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(args=args, run=run, **kwargs)

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(FederatedLoop, "trainer", instantiate=False, sub_configs=True, skip={"seed"})
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items()})
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "datamodule"}, "validate": {"model", "datamodule"}, "test": {"model", "datamodule"}}

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as e:
            raise _config_error_in(e) from None

    def _parse_ckpt_path(self) -> None:
        """Our checkpoints carry no Lightning hyper-parameters; the loop loads and validates them itself."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        cfg = self._get(self.config_init, "trainer", default=Namespace())
        cfg = dict(cfg.items()) if isinstance(cfg, Namespace) else dict(cfg)
        cfg = {k: v for k, v in cfg.items() if "." not in k}
        seed = self._get(self.config, "seed_everything")
        cfg["seed"] = int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else 0
        loop = FederatedLoop(**{**cfg, **kwargs})
        loop.config_text = self._config_text()
        return loop

    def _config_text(self) -> str:
        """The full configuration as YAML, with the resolved seed and without ``ckpt_path``."""
        parser = self._parser(self.subcommand)
        cfg = self.config.get(str(self.subcommand), self.config).clone()
        if "ckpt_path" in cfg:
            cfg["ckpt_path"] = None
        text = parser.dump(cfg, skip_none=False, skip_link_targets=False)
        data = yaml.safe_load(text)
        header = "# written by pl-fed; reproduce with: pl-fed fit --config config.yaml\n"
        return header + yaml.safe_dump(data, sort_keys=False)


_OUR_FORMAT = re.compile(r"(\S+=.+ is invalid: expected .+)$")


def _config_error_in(exc: BaseException) -> BaseException:
    """The :class:`ConfigError` behind an exception jsonargparse raised while instantiating a class.

    jsonargparse re-raises constructor errors of nested classes (e.g. a callback in ``trainer.callbacks``) as a
    ``ValueError`` listing every type it tried; the user's mistake is the line in our own format.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        seen = seen.__cause__ or seen.__context__
    for line in str(exc).splitlines():
        m = _OUR_FORMAT.search(line.strip().lstrip("- ").strip())
        if m:
            return ConfigError(m.group(1))
    return exc


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pl-fed`` console script."""
    # make classes in the working directory (e.g. the repository's top-level callbacks/) importable by class_path
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        FedCLI(args=argv)
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted: resume with --ckpt_path <run>/checkpoints/last.ckpt\n")
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
