"""`Registry`: one type for every table of named things; it refuses a second entry under a name and an entry of
another type, keeps the order of registration, reads as a mapping and lists its names as the messages do."""

from collections.abc import Callable, Mapping

import pytest

from doplus_cli.registry import Registry


def test_a_duplicate_name_is_refused_naming_the_registry_and_the_name():
    colours = Registry("colour", int, {"red": 1})
    with pytest.raises(ValueError, match=r"^colour registry: 'red' is already registered$"):
        colours.register("red", 2)
    with pytest.raises(ValueError, match="'blue' is already registered"):
        Registry("colour", int, [("blue", 1), ("blue", 1)])
    assert colours["red"] == 1 and len(colours) == 1  # the first entry stays


def test_an_entry_of_another_type_is_refused():
    with pytest.raises(TypeError, match=r"^colour registry: 'red' must be of type int, not str$"):
        Registry("colour", int, {"red": "1"})
    numbers = Registry("number", (int, float))
    with pytest.raises(TypeError, match="'x' must be of type int or float, not NoneType"):
        numbers.register("x", None)
    with pytest.raises(ValueError, match="a name must be a non-empty string"):
        numbers.register("", 1)
    assert "x" not in numbers and list(numbers) == []


def test_the_order_of_registration_is_kept():
    names = ["zeta", "alpha", "mu", "beta"]
    registry = Registry("letter", int, [(name, i) for i, name in enumerate(names)])
    assert list(registry) == names and [value for _, value in registry.items()] == [0, 1, 2, 3]
    registry.register("aa", 4)
    assert list(registry.keys())[-1] == "aa"


def test_it_reads_as_a_read_only_mapping():
    registry = Registry("colour", int, {"red": 1, "green": 2})
    assert isinstance(registry, Mapping)
    assert "red" in registry and "blue" not in registry and 3 not in registry
    assert registry["green"] == 2 and registry.get("blue") is None and registry.get("blue", 7) == 7
    assert dict(registry) == {"red": 1, "green": 2} and registry == {"red": 1, "green": 2}
    assert list(registry.values()) == [1, 2] and len(registry) == 2 and tuple(registry) == ("red", "green")
    with pytest.raises(KeyError):
        registry["blue"]
    with pytest.raises(TypeError):
        registry["blue"] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        del registry["red"]  # type: ignore[attr-defined]


def test_the_decorator_registers_the_function_or_what_build_makes_of_it():
    functions = Registry("function", Callable)

    @functions.register("double")
    def double(x):
        return 2 * x

    assert functions["double"] is double and double(3) == 6  # the function comes back unchanged
    lengths = Registry("length", int)

    @lengths.register("three", build=lambda fn: fn(3))
    def triple(x):
        return 3 * x

    assert lengths["three"] == 9 and triple(1) == 3
    with pytest.raises(ValueError, match="function registry: 'double' is already registered"):
        functions.register("double")(lambda x: x)


def test_the_listing_joins_the_names_as_the_messages_do():
    registry = Registry("loss", int, {"GA": 1, "NPO": 2, "CE-U": 3})
    assert registry.listing() == "GA, NPO, CE-U" == ", ".join(["GA", "NPO", "CE-U"])
    assert registry.listing(" | ") == "GA | NPO | CE-U"
    assert Registry("loss", int).listing() == ""
    assert repr(registry) == "Registry('loss': GA, NPO, CE-U)"


def test_declared_names_refuse_any_other_and_say_which_have_no_entry():
    metrics = Registry("task metric", int, {"exact": 1}, names=("exact", "choice", "rouge_l"))
    with pytest.raises(ValueError, match=r"'edit' is not one of its names \(exact, choice, rouge_l\)"):
        metrics.register("edit", 2)
    with pytest.raises(ValueError, match=r"^task metric registry: no entry for choice, rouge_l$"):
        metrics.check_complete()
    metrics.register("choice", 2)
    metrics.register("rouge_l", 3)
    metrics.check_complete()
    Registry("free", int).check_complete()  # without declared names nothing is missing


def test_replaced_swaps_an_entry_for_the_block_and_restores_it():
    registry = Registry("colour", int, {"red": 1, "green": 2})
    with registry.replaced("red", 10) as original:
        assert original == 1 and registry["red"] == 10 and list(registry) == ["red", "green"]
    assert registry["red"] == 1
    with pytest.raises(RuntimeError), registry.replaced("green", 20):
        raise RuntimeError("the block failed")
    assert registry["green"] == 2
    with pytest.raises(KeyError), registry.replaced("blue", 3):
        pass
    with pytest.raises(TypeError, match="'red' must be of type int"), registry.replaced("red", "one"):
        pass
    assert registry["red"] == 1


def test_the_package_registries_keep_their_names_and_messages():
    """The converted tables hold what the plain dicts held, in order, and the messages built from them read as
    before (the names joined by ", ")."""
    from doplus_cli.bench.schemes.planning import parse_schemes
    from doplus_cli.commands import COMMANDS
    from doplus_cli.config import FORGET_LOSS_NAMES, SCHEMES, TASK_METRIC_NAMES
    from doplus_cli.data.formatting import PROMPT_TEMPLATES, resolve_template
    from doplus_cli.errors import UserError
    from doplus_cli.evaluation.task_metrics import TASK_METRICS
    from doplus_cli.losses import FORGET_LOSSES, RETAIN_LOSSES, TASK_LOSSES

    assert FORGET_LOSS_NAMES == ("GA", "NPO", "DPO", "ME", "IDK", "SimNPO", "WGA", "SatImp", "UNDIAL", "CE-U", "RMU")
    assert tuple(FORGET_LOSSES) == FORGET_LOSS_NAMES and list(RETAIN_LOSSES) == ["GD", "KL", "AP", "EMBED"]
    assert list(TASK_LOSSES) == ["CE"] and all(spec.name == name for name, spec in FORGET_LOSSES.items())
    assert tuple(TASK_METRICS) == TASK_METRIC_NAMES == ("exact", "choice", "edit_sim", "rouge_l")
    assert list(COMMANDS) == ["unlearn", "multitask", "align"]  # the order of `doplus --help`
    assert list(PROMPT_TEMPLATES) == ["question-answer", "phi-tofu", "llama2"]
    with pytest.raises(UserError) as error:
        parse_schemes("joint,nope")
    assert str(error.value) == "unknown scheme 'nope' in --schemes: choose from " + ", ".join(list(SCHEMES))

    class NoChat:
        chat_template = None

    with pytest.raises(UserError) as error:
        resolve_template(NoChat(), "chat")
    assert str(error.value) == ("--prompt-template chat: this tokenizer has no chat template; choose question-answer, "
                                "phi-tofu, llama2 or a string with {question}")
