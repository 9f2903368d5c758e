"""A reply's arrays must be exactly what the client was sent: fuzzed with hypothesis."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.reporting import arrays_problem, arrays_signature

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from([np.float32, np.float64, np.int64])
records = st.dictionaries(
    st.from_regex(r"[0-4]\.[a-z]{1,6}", fullmatch=True), st.tuples(shapes, dtypes),
    min_size=1, max_size=6,
)


def build(spec: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.zeros(shape, dtype=dtype)) for k, (shape, dtype) in
                        spec.items()})


@settings(max_examples=60, deadline=None)
@given(records)
def test_what_was_sent_comes_back_accepted(spec):
    record = build(spec)
    assert arrays_problem(build(spec), arrays_signature(record)) is None


@settings(max_examples=120, deadline=None)
@given(records, st.sampled_from(["extra", "missing", "shape", "dtype", "nan", "inf"]),
       st.data())
def test_every_kind_of_tampering_is_refused(spec, tamper, data):
    sent = arrays_signature(build(spec))
    returned = dict(build(spec).items())
    key = data.draw(st.sampled_from(sorted(spec)))
    shape, dtype = spec[key]
    if tamper == "extra":
        returned["9.stolen"] = Array(np.zeros(2, dtype=np.float32))
    elif tamper == "missing":
        del returned[key]
    elif tamper == "shape":
        returned[key] = Array(np.zeros((*shape, 2), dtype=dtype))
    elif tamper == "dtype":
        other = np.float16 if dtype != np.float16 else np.float32
        returned[key] = Array(np.zeros(shape, dtype=other))
    else:  # an integer array cannot hold NaN: it comes back as float, refused either way
        values = np.zeros(shape, dtype=np.float32 if dtype == np.int64 else dtype)
        values.reshape(-1)[:1] = np.nan if tamper == "nan" else np.inf
        returned[key] = Array(values)
    assert arrays_problem(ArrayRecord(returned), sent) is not None


def test_without_a_record_of_sending_only_finiteness_is_checked():
    record = build({"0.w": ((3,), np.float32)})
    assert arrays_problem(record, None) is None
    bad = ArrayRecord({"0.w": Array(np.array([1.0, np.nan], dtype=np.float32))})
    assert "not finite" in arrays_problem(bad, None)
    assert arrays_problem(None, None) == "no weights in the reply"
