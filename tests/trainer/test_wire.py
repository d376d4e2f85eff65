import time

import pytest

from trainer.wire import WireError, parse_batch


def _batch(**over):
    now = time.time()
    b = {"v": 1, "sent_at": now, "heartbeats": [{"rank": 0, "step": 1, "phase": "train", "at": now}],
         "events": [{"id": "e1", "kind": "fault", "at": now, "data": {}}]}
    b.update(over)
    return b


@pytest.mark.parametrize("field,value,path", [
    ("heartbeats", [{"rank": 0, "step": 1, "phase": ["train"], "at": 0.0}], "heartbeats[0].phase"),
    ("events", [{"id": "x", "kind": {"k": 1}, "at": 0.0}], "events[0].kind"),
    ("v", [1], "v"),
])
def test_it_refuses_unhashable_values_with_a_field_error(field, value, path):
    b = _batch(**{field: value})
    if field != "v":
        for item in b[field]:
            item["at"] = b["sent_at"]
    with pytest.raises(WireError) as e:
        parse_batch(b, now=b["sent_at"])
    assert e.value.field == path


def test_it_names_the_unknown_rank():
    with pytest.raises(WireError) as e:
        parse_batch(_batch(), now=time.time(), world_size=0)
    assert e.value.field == "heartbeats[0].rank" and "unknown rank 0" in e.value.message


def test_it_refuses_clock_skew():
    b = _batch(sent_at=time.time() + 3600)
    with pytest.raises(WireError) as e:
        parse_batch(b, now=time.time())
    assert e.value.field == "sent_at" and "clock skew" in e.value.message


def test_it_redacts_secrets_from_evidence():
    from trainer.wire import redact

    assert redact("HF_TOKEN=hf_abcdefghijklmnopqrstuvwx ok") == "HF_TOKEN=[redacted] ok"
    assert redact("Authorization: Bearer abcdefgh12345678") == "Authorization: Bearer [redacted]"
    assert redact('db password: "hunter22" x') == 'db password: "[redacted]" x'
    assert redact("https://user:pa55word@host/x") == "https://user:[redacted]@host/x"
    assert redact("key AKIAABCDEFGHIJKLMNOP here") == "key [redacted] here"
    assert redact("sent with t0ken-abcdef", ("t0ken-abcdef",)) == "sent with [redacted]"
    # Ordinary words stay: a fault message must remain readable.
    assert redact("token count 5 at step 410: loss is nan") == "token count 5 at step 410: loss is nan"


def test_it_redacts_values_of_secret_names_and_token_shapes_not_code():
    from trainer.wire import redact

    # Code in a traceback stays code: tokens=, max_tokens=, token_count=, tokenizer= are not secrets.
    for code in ("    ctx.step(step + 1, loss=loss_v, tokens=batch[0].numel())",
                 "    ctx.step(step + 1, loss=loss_v, tokens=tokens))",
                 "generate(ids, max_tokens=128, token_count=n, tokenizer=tok)"):
        assert redact(code) == code
    # Idempotent: the trainer, ingest and the page each redact; a second pass adds nothing.
    once = redact("failed with HF_TOKEN=hf_abcdefghijklmnopqrstuvwx and password: hunter22")
    assert once == "failed with HF_TOKEN=[redacted] and password: [redacted]"
    assert redact(redact(once)) == once
    # An environment printed as a dict, values with known shapes whatever their names, our ingest tokens.
    assert redact("{'DB_PASS': 'hunter22', 'PATH': '/bin'}") == "{'DB_PASS': '[redacted]', 'PATH': '/bin'}"
    assert redact("OPENAI_KEY=sk-abcdefghijklmnopqrstuvwx1") == "OPENAI_KEY=[redacted]"
    shapes = "id AKIAABCDEFGHIJKLMNOP gh ghp_abcdefghijklmnopqrstuvwxyz0123"
    assert redact(shapes) == "id [redacted] gh [redacted]"
    assert redact("my token is ubk_" + "x" * 43 + ".") == "my token is [redacted]."
    assert redact("UNBROKEN_TOKEN_FILE=/data/jobs/3/token") == "UNBROKEN_TOKEN_FILE=/data/jobs/3/token"


# --- one definition: the column-wise fast check and the parser are the same rules -----------------------

import math  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trainer import wire  # noqa: E402

NOW = 1_800_000_000.0
WINDOW = wire.Window(earliest=NOW - wire.DEFAULT_MAX_AGE_S, latest=NOW + wire.MAX_FUTURE_S, world_size=4)
_MISSING = object()


def _values(rule: wire.Rule):
    """(good, odd) values a sender might put in a field with this rule: odd ones are each bound and one
    past it, the wrong JSON types and null."""
    wrong = [True, "x", [], {}, 1.5, -1, None, _MISSING]
    if rule.type in ("integer", "rank"):
        hi = int(rule.hi if rule.hi is not None else wire.MAX_INT64)
        edges = [0, 3, 4, hi, hi + 1, -1]
        good = st.integers(0, 3 if rule.type == "rank" else hi)
    elif rule.type == "number":
        lo, hi = rule.lo, rule.hi
        edges = [0, 0.0, -0.5, 1e300] + ([hi, hi + 1, hi * 2] if hi is not None else [])
        good = st.floats(lo if lo is not None else -1e300, hi if hi is not None else 1e300, allow_nan=False)
    elif rule.type == "time":
        edges = [WINDOW.earliest, WINDOW.earliest - 1, WINDOW.latest, WINDOW.latest + 0.1, 0, NOW]
        good = st.floats(WINDOW.earliest, WINDOW.latest)
    elif rule.type == "word":
        edges = [*sorted(rule.choices), "TRAIN", ""]
        good = st.sampled_from(sorted(rule.choices))
    else:
        edges = ["", "a" * rule.max_len, "a" * (rule.max_len + 1), "n\x00de"]
        good = st.text(max_size=rule.max_len).filter(lambda s: "\x00" not in s)
    return good, st.sampled_from(edges + wrong)


@st.composite
def _beat(draw):
    """A good heartbeat with none, one or two of its fields odd (and sometimes a key the wire lacks)."""
    h = {name: draw(_values(rule)[0]) for name, rule in wire.HEARTBEAT_RULES.items()}
    for name in draw(st.lists(st.sampled_from(list(wire.HEARTBEAT_RULES)), max_size=2)):
        h[name] = draw(_values(wire.HEARTBEAT_RULES[name])[1])
    h = {k: v for k, v in h.items() if v is not _MISSING}
    if draw(st.integers(0, 19)) == 0:
        h["unknown_key"] = 1
    return h


def _parse_all(hbs):
    try:
        return [wire.parse_heartbeat(h, f"heartbeats[{i}]", WINDOW) for i, h in enumerate(hbs)]
    except wire.WireError:
        return None


@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(_beat(), min_size=1, max_size=4))
def test_the_fast_check_accepts_exactly_what_the_parser_accepts(hbs):
    parsed = _parse_all(hbs)
    known_keys_only = all(set(h) <= set(wire.HEARTBEAT_RULES) for h in hbs)
    assert wire.heartbeats_ok(hbs, WINDOW) == (parsed is not None and known_keys_only), hbs
    if parsed is not None:
        for h, p in zip(hbs, parsed, strict=True):
            assert wire.as_dict(p) == {**wire.HEARTBEAT_DEFAULTS, **{k: v for k, v in h.items() if k != "unknown_key"}}


def test_every_field_has_one_rule_that_the_schema_and_the_parser_share():
    """A heartbeat's fields are the dataclass's; each rule's JSON Schema holds the values it accepts."""
    assert list(wire.HEARTBEAT_RULES) == [f for f in wire.Heartbeat.__slots__]
    assert wire.HEARTBEAT_REQUIRED == ("rank", "step", "phase", "at")
    rank = wire.HEARTBEAT_RULES["rank"].schema()
    assert (rank["minimum"], rank["maximum"]) == (0, wire.MAX_RANK)
    pid = wire.HEARTBEAT_RULES["pid"].schema()
    assert pid["type"] == ["integer", "null"] and pid["maximum"] == wire.MAX_PID
    assert wire.HEARTBEAT_RULES["loss"].check(math.inf, "loss") is None  # a NaN drill's loss: kept as null
