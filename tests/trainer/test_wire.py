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
