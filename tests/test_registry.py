"""Names, factories and fail-fast validation: everything here runs before any process starts."""

import copy
import pickle

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_gradcomp as gc
from lightning_gradcomp import CompressedDDPStrategy, available_codecs, make_codec

BASELINES = ["none", "fp16", "topk", "qsgd", "terngrad", "powersgd"]


def test_baselines_are_registered():
    assert set(BASELINES) <= set(available_codecs())
    for name in BASELINES:
        assert make_codec(name).name == name


def test_unknown_codec_names_the_valid_choices():
    with pytest.raises(ValueError, match="unknown codec 'zip'.*topk"):
        make_codec("zip")
    with pytest.raises(ValueError, match="unknown codec"):
        CompressedDDPStrategy(codec="zip")


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("topk", {"ratio": -0.1}, "ratio must be in"),
        ("topk", {"ratio": 1.5}, "ratio must be in"),
        ("topk", {"sample_fraction": -0.1}, "sample_fraction must be in"),
        ("topk", {"sample_fraction": 1.5}, "sample_fraction must be in"),
        ("randk", {"ratio": 0.0}, "ratio must be in"),
        ("qsgd", {"levels": 0}, "levels"),
        ("qsgd", {"levels": 300}, "levels must be <= 127"),
        ("qsgd", {"levels": 128}, "levels must be <= 127"),  # 2 * 128 + 1 codes need 9 bits
        ("terngrad", {"clip": -1.0}, "clip"),
        ("powersgd", {"rank": 0}, "rank"),
        ("topk", {"min_numel": -5}, "min_numel"),
        ("topk", {"not_an_option": 1}, "Valid options: .*ratio"),
        ("none", {"error_feedback": True}, "drops nothing"),
        # a string from a YAML or JSON file must not pass as a switch: bool("false") is True
        ("powersgd", {"warm_start": "false"}, "warm_start must be True or False, got 'false'"),
        ("powersgd", {"use_error_feedback": 0}, "use_error_feedback must be True or False"),
        ("gradiveq", {"center": "yes"}, "center must be True or False"),
        ("lgc", {"ae_error_feedback": None}, "ae_error_feedback must be True or False"),
        ("topk", {"error_feedback": "true"}, "error_feedback must be True or False"),
        ("topk", {"momentum": 0.9, "nesterov": 1}, "nesterov must be True or False"),
        # nor a switch as a number: True would be a ratio of 1
        ("topk", {"ratio": True}, r"ratio must be in \(0, 1\], got True"),
        ("lgc", {"max_recon_error": True}, "max_recon_error must be a number > 0"),
        ("lgc", {"ae_time_budget_s": True}, "ae_time_budget_s must be a number > 0"),
        ("topk", {"ratio": "0.01"}, "ratio must be in"),
        # seeds: integers every generator takes (numpy's PowerSGD generator: below 2**32)
        ("topk", {"seed": -1}, r"seed must be an integer in \[0, 2\*\*32\), got -1"),
        ("fft", {"seed": 1.5}, "seed must be an integer"),
        ("powersgd", {"seed": 2**32}, "seed must be an integer"),
        ("iwp", {"seed": True}, "seed must be an integer"),
    ],
)
def test_invalid_options_fail_fast(name, options, match):
    with pytest.raises(ValueError, match=match):
        make_codec(name, **options)
    with pytest.raises(ValueError, match=match):
        CompressedDDPStrategy(codec=name, codec_options=options)


def test_strategy_rejects_foreign_hooks_and_bad_policies():
    foreign = {
        "ddp_comm_hook": lambda s, b: None,
        "ddp_comm_state": object(),
        "ddp_comm_wrapper": lambda hook: hook,
        "model_averaging_period": 4,  # post-local SGD: it would replace the hook after some steps
    }
    for option, value in foreign.items():
        with pytest.raises(ValueError, match=f"registers its own communication hook; '{option}'"):
            CompressedDDPStrategy(codec="topk", **{option: value})
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        CompressedDDPStrategy(codec="topk", nonfinite="ignore")
    # what Lightning would only find out when it starts the processes, or never (a string switch)
    with pytest.raises(ValueError, match="fallback must be True, False or None"):
        CompressedDDPStrategy(codec="topk", fallback="false")
    with pytest.raises(ValueError, match=r"start_method must be one of \['popen', 'spawn', 'fork', 'forkserver'\]"):
        CompressedDDPStrategy(codec="topk", start_method="thread")
    with pytest.raises(ValueError, match="timeout must be a datetime.timedelta or None"):
        CompressedDDPStrategy(codec="topk", timeout=30)
    with pytest.raises(ValueError, match="stats_every must be an integer >= 1"):
        CompressedDDPStrategy(codec="topk", stats_every=True)
    with pytest.raises(ValueError, match="codec_options are only used with a codec name"):
        CompressedDDPStrategy(codec=make_codec("topk"), codec_options={"ratio": 0.1})


def test_ddp_options_pass_through():
    s = CompressedDDPStrategy(codec="fp16", find_unused_parameters=True, static_graph=False, bucket_cap_mb=5)
    assert s._ddp_kwargs == {"find_unused_parameters": True, "static_graph": False, "bucket_cap_mb": 5}
    assert s.codec.name == "fp16"


def test_strategy_names_in_lightning_registry():
    assert "compressed_ddp" in StrategyRegistry
    assert StrategyRegistry["compressed_ddp_spawn"]["init_params"] == {"start_method": "spawn"}
    for name in available_codecs():
        assert StrategyRegistry[f"compressed_ddp_{name}"]["init_params"] == {"codec": name}
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="compressed_ddp_topk", logger=False)
    assert isinstance(trainer.strategy, CompressedDDPStrategy)
    assert trainer.strategy.codec.name == "topk"


def test_codec_options_are_part_of_the_config_digest():
    assert make_codec("topk", ratio=0.01).config_hash() == make_codec("topk", ratio=0.01).config_hash()
    assert make_codec("topk", ratio=0.01).config_hash() != make_codec("topk", ratio=0.02).config_hash()
    assert make_codec("topk").config_hash() != make_codec("qsgd").config_hash()


def test_the_wire_format_is_part_of_the_config_digest(monkeypatch):
    from lightning_gradcomp.registry import codec_class

    # ranks whose versions lay TernGrad's codes out differently must not agree
    before = make_codec("terngrad").config_hash()
    before_auto = make_codec("auto", candidates=["none", "terngrad"]).config_hash()
    before_lgc = make_codec("lgc", warmup_codec="terngrad").config_hash()
    monkeypatch.setattr(codec_class("terngrad"), "wire_format", 1)
    assert make_codec("terngrad").wire_formats() == {"terngrad": 1}
    assert make_codec("terngrad").config_hash() != before
    # lgc sends TernGrad's messages in stage 1 with warmup_codec="terngrad", and only then
    assert make_codec("lgc", warmup_codec="terngrad").wire_formats() == {"lgc": 1, "terngrad": 1}
    assert make_codec("lgc").wire_formats() == {"lgc": 1}
    assert make_codec("lgc", warmup_codec="terngrad").config_hash() != before_lgc
    # auto sends its arms' messages, so their layouts are part of its digest too
    assert make_codec("auto", candidates=["none", "terngrad"]).wire_formats() == {"none": 1, "terngrad": 1, "auto": 1}
    assert make_codec("auto", candidates=["none", "terngrad"]).config_hash() != before_auto


@pytest.fixture
def user_registry(monkeypatch):
    """Codecs a test registers are forgotten after it, so ``available_codecs()`` stays the built-ins."""
    from lightning_gradcomp import registry

    monkeypatch.setattr(registry, "_USER", dict(registry._USER))


def test_user_codecs_can_be_registered(user_registry):
    @gc.register_codec("my_identity")
    class Identity(gc.Codec):
        collective = "allreduce"

        def encode(self, x, key, param, step):
            return gc.EncodeResult([x.clone()], local=x)

        def decode(self, payload, ctx, numel, count):
            return payload[0]

    assert "my_identity" in available_codecs()
    assert isinstance(make_codec("my_identity"), Identity)


def test_a_user_codec_wins_over_a_built_in_of_the_same_name(user_registry):
    from lightning_gradcomp.registry import codec_class

    builtin = codec_class("topk")

    @gc.register_codec("topk")
    class MyTopK(builtin):
        pass

    assert codec_class("topk") is MyTopK and isinstance(make_codec("topk"), MyTopK)
    assert available_codecs().count("topk") == 1


@pytest.fixture
def fresh_discovery(monkeypatch, tmp_path):
    """The codecs package with ``tmp_path`` as one more of its folders, and discovery not yet run."""
    import importlib

    from lightning_gradcomp import codecs, registry

    monkeypatch.setattr(codecs, "__path__", [*codecs.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.setattr(registry, "_BUILTIN", dict(registry._BUILTIN))
    importlib.invalidate_caches()
    return tmp_path


def test_a_codec_module_with_a_missing_dependency_is_skipped_with_a_warning(fresh_discovery):
    (fresh_discovery / "needs_a_package.py").write_text("import a_package_that_is_not_installed\n")
    with pytest.warns(RuntimeWarning, match="codec module 'needs_a_package' not loaded: .*a_package_that_is_not"):
        names = available_codecs()
    assert set(BASELINES) <= set(names)


def test_a_broken_codec_module_fails_loudly_and_every_time(fresh_discovery):
    from lightning_gradcomp import registry

    (fresh_discovery / "broken.py").write_text("raise RuntimeError('a bug in the codec module')\n")
    for _ in range(2):  # not once and then silently without it
        with pytest.raises(RuntimeError, match="a bug in the codec module"):
            available_codecs()
        assert registry._discovered is False


def test_every_codec_module_of_the_package_is_found_without_a_list():
    import re
    from pathlib import Path

    from lightning_gradcomp import registry

    package = Path(registry.__file__).parent / "codecs"
    declared = {m for f in package.glob("*.py") for m in re.findall(r'@register_codec\("(\w+)"\)', f.read_text())}
    assert declared and declared == set(available_codecs()) == set(registry._BUILTIN)
    assert all(registry.codec_class(n).__module__.startswith("lightning_gradcomp.codecs.") for n in declared)


def test_resolve_codec_lives_in_the_registry_and_at_its_old_path():
    from lightning_gradcomp import registry, strategy

    assert strategy.resolve_codec is registry.resolve_codec
    assert registry.resolve_codec("topk", {"ratio": 0.1}).options.ratio == 0.1


def test_the_adding_a_codec_example_in_the_docs_works(user_registry):
    import re
    from pathlib import Path

    import torch

    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    code = re.search(r"## Adding a codec\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "design.md", "exec"), {})
    codec = make_codec("sign", damping=0.5)
    assert codec.harness.error_feedback and codec.config()["damping"] == 0.5
    codec.setup(gc.CodecContext(0, 1, torch.device("cpu")))
    x = torch.randn(100)
    enc = codec.encode(x, "w", x, 3)
    assert torch.equal(codec.decode(enc.payload, None, 100, 1), enc.local)
    assert torch.equal(enc.local.sign(), x.sign())


# What the options of every codec were called before they became declared dataclasses; the only
# differences are the run-time and derived values that no longer pass for options.
_OPTION_CHANGES = {
    ("gradiveq", "num_components"): (4, None),  # None: resolved when used (4, or slice_dim with a variance target)
    ("gradiveq", "quant_scale"): ("<absent>", "layer"),  # what it did before; "component" measured worse
    ("gradiveq", "quant_rounding"): ("<absent>", "stochastic"),  # what it did before; "nearest" measured worse
    ("gradiveq", "quant_fill"): ("<absent>", False),  # levels as given, as before
    ("lgc", "code"): ("<absent>", "levels"),  # the learned code of stage 3 (the AE is code="autoencoder")
    ("lgc", "code_bits"): ("<absent>", 2),
    ("lgc", "density_warmup"): ("<absent>", 0),  # DGC's warm-up of sparsity after stage 1, off by default
    ("lgc", "density_warmup_start"): ("<absent>", 0.25),
    ("lgc", "refit_every"): ("<absent>", 100),  # the levels fitted again in stage 3
    ("lgc", "code_denser"): ("<absent>", True),  # the code also carries the controller's denser support
    ("lgc", "light_ratio"): ("<absent>", None),  # None: the light level's support as before (10 x ratio, <= 0.25)
    ("lgc", "light_code_bits"): ("<absent>", None),  # None: code_bits at the light steps too, as before
    ("lgc", "light_scale"): ("<absent>", "message"),  # one scale a message at the light steps, as before
    ("lgc", "position_code"): ("<absent>", "kernel"),  # a union support's names per kernel and channel; lossless
    ("lgc", "ratio"): (0.01, 0.0075),  # a steady ratio of 300 on ResNet-18 (docs/codecs/lgc.md)
    ("lgc", "warmup_codec"): ("<absent>", "allreduce"),  # stage 1 dense unless PowerSGD or TernGrad is asked for
    ("lgc", "warmup_rank"): ("<absent>", 4),
    ("lgc", "support"): ("<absent>", "leader"),  # the leader names the support, as before ("union": every rank)
    ("iwp", "last_encodings"): ([], "<absent>"),  # introspection of the last bucket, now plain attributes
    ("iwp", "last_index_bytes"): (0, "<absent>"),
    ("iwp", "last_root"): (-1, "<absent>"),
    ("powersgd", "rank"): ("<absent>", 4),  # the option is called rank; rank_r was its stored copy
    ("powersgd", "rank_r"): (4, "<absent>"),
    ("qsgd", "bits"): (4, "<absent>"),  # derived from levels: a read-only property now
}
# harness options added since, which every codec takes: their default for each codec
_HARNESS_ADDED = {
    "precondition": {"default": False},
    "dense_dtype": {"default": "float32", "lgc": "bfloat16"},
    "plain_dtype": {"default": "float32"},
    "deflate": {"default": False},  # lossless; off for every codec
}


def test_options_keep_their_names_and_defaults():
    import json
    from pathlib import Path

    before = json.loads((Path(__file__).parent / "data" / "options_before.json").read_text())
    assert set(before) <= set(available_codecs())  # codecs added since have no snapshot to keep
    changed = {}
    for name in before:
        now = make_codec(name).config()
        for key in set(before[name]) | set(now):
            old, new = before[name].get(key, "<absent>"), now.get(key, "<absent>")
            if old != new:
                changed[(name, key)] = (old, new)
    added = {
        (name, option): ("<absent>", defaults.get(name, defaults["default"]))
        for option, defaults in _HARNESS_ADDED.items()
        for name in before
    }
    assert changed == {**_OPTION_CHANGES, **added}


@pytest.mark.parametrize("name", available_codecs())
def test_config_round_trips_through_make_codec(name):
    codec = make_codec(name)
    again = make_codec(name, **codec.config())
    assert again.config() == codec.config() and again.config_hash() == codec.config_hash()


def test_replace_options_checks_the_new_values():
    codec = make_codec("topk")
    codec.replace_options(ratio=0.1)
    assert codec.options.ratio == 0.1 and codec.config()["ratio"] == 0.1
    with pytest.raises(ValueError, match="ratio must be in"):
        codec.replace_options(ratio=2.0)
    with pytest.raises(ValueError, match="no option 'not_an_option'.*ratio"):
        codec.replace_options(not_an_option=1)
    # valid on its own, refused with the harness's momentum correction: nothing changes
    lgc = make_codec("lgc", momentum=0.9)
    with pytest.raises(ValueError, match="warmup_codec='powersgd'"):
        lgc.replace_options(warmup_codec="powersgd")
    assert lgc.options.warmup_codec == "allreduce" and lgc.config() == make_codec("lgc", momentum=0.9).config()
    # adopted defaults set the codec's own options and the harness's alike
    topk = make_codec("topk")
    topk.adopt_defaults({"ratio": 0.1, "error_feedback": False})
    assert (topk.options.ratio, topk.harness.error_feedback) == (0.1, False)


def test_the_harness_contract_of_every_codec():
    """What a codec inherits: a parameter of exactly ``min_numel`` entries is compressed; a run
    length that is not a positive number is unknown; a user codec that only decodes gets the sum
    of every rank's decoded payloads; without error feedback the defaults beside Adam that need
    it are dropped; the context keeps its group through a copy and drops it when pickled."""
    from lightning_gradcomp import CodecContext
    from lightning_gradcomp.codecs.base import Codec

    topk = make_codec("topk", min_numel=1000)
    assert topk.should_compress("w", torch.zeros(1000)) and not topk.should_compress("w", torch.zeros(999))
    for bad in (0, -5, float("inf"), float("nan")):
        topk.fit_to_run(bad)
        assert topk.run_total_steps is None
    topk.fit_to_run(781.0)
    assert topk.run_total_steps == 781

    class Halves(Codec):  # allgather, with the base class's aggregate
        def encode(self, x, key, param, step):
            raise NotImplementedError

        def decode(self, payload, ctx, numel, count):
            return payload[0] / 2

    parts = [[torch.full((3,), 2.0)], [torch.full((3,), 4.0)], [torch.tensor([6.0, 0.0, 2.0])]]
    assert Halves().aggregate(parts, None, 3).tolist() == [6.0, 3.0, 4.0]

    assert "plain_dtype" in make_codec("lgc").optimizer_defaults()
    assert "plain_dtype" not in make_codec("lgc", error_feedback=False).optimizer_defaults()

    group = ("a", "group")  # stands for a process group
    context = CodecContext(1, 2, torch.device("cpu"), group)
    assert copy.deepcopy(context).group is group
    assert pickle.loads(pickle.dumps(context)).group is None


def test_positive_float_keeps_each_codecs_accepted_values():
    import math

    from lightning_gradcomp.codecs.options import check_positive_float

    assert check_positive_float("x", 2) == 2.0 and check_positive_float("x", 0, allow_zero=True) == 0.0
    assert check_positive_float("x", math.inf, allow_inf=True) == math.inf
    for bad, kw in [(0, {}), (-1.0, {"allow_zero": True}), (math.inf, {}), (math.nan, {}), (True, {}), ("1", {})]:
        with pytest.raises(ValueError, match="x must be a .*number"):
            check_positive_float("x", bad, **kw)
    assert make_codec("terngrad", clip=math.inf).options.clip == math.inf  # no clipping, as before
    assert make_codec("powersgd", min_compression_rate=math.inf).options.min_compression_rate == math.inf
    for name, options, match in [
        ("iwp", {"eps": math.inf}, "eps must be a finite number > 0"),
        ("terngrad", {"clip": -1.0}, r"clip must be a number >= 0 \(0 disables clipping\)"),
        ("powersgd", {"min_compression_rate": 0}, "min_compression_rate must be a number > 0"),
        ("topk", {"momentum": 0.9, "weight_decay": math.inf}, "weight_decay must be a finite number >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_codec(name, **options)


def test_moved_names_import_from_where_they_were():
    from lightning_gradcomp.codecs import base, extensions, options, sampling
    from lightning_gradcomp.hook import layers

    assert base.HarnessOptions is options.HarnessOptions and base.check_run_steps is options.check_run_steps
    assert base.DensityWarmup is sampling.DensityWarmup and base.AdjustableLevel is extensions.AdjustableLevel
    assert base.weight_layer_ends is layers.weight_layer_ends and base.AUTO_DENSE_MAX_SHARE == 0.05
    import lightning_gradcomp.codecs as codecs

    assert all(hasattr(codecs, n) for n in base.__all__)
