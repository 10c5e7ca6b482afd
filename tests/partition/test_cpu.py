from partition.cpu import split_cores


def test_enough_cores_gives_disjoint_shares() -> None:
    shares = split_cores(list(range(8)), num_units=2, with_prefill=True)
    assert shares == [((0, 1), (2, 3)), ((4, 5), (6, 7))]
    used = [c for d, p in shares for c in d + p]
    assert len(used) == len(set(used))


def test_aggregated_unit_takes_its_whole_slice() -> None:
    assert split_cores(list(range(4)), num_units=2, with_prefill=False) == [
        ((0, 1), ()),
        ((2, 3), ()),
    ]


def test_fewer_cores_than_workers_shares_round_robin() -> None:
    assert split_cores([0, 1], num_units=2, with_prefill=True) == [((0,), (1,)), ((0,), (1,))]
    assert split_cores([0], num_units=1, with_prefill=True) == [((0,), (0,))]
    assert all(d and p for d, p in split_cores([0, 1, 2], num_units=2, with_prefill=True))
