"""issue395.text: the one fixed-width helper and a number's cell (real; nothing faked)."""

from __future__ import annotations

from issue395.text import gb, ratio, table


def test_a_cell_wider_than_its_column_widens_it_so_every_line_stays_aligned():
    lines = table([("arm", -4), ("GB", 6), ("note", -5)],
                  [["a", "1.0", "x"], ["a-long-family-name", "12.5", "a note longer than its column"]])
    head, rule, short, long = lines
    assert head.index("GB") + 2 == short.index("1.0") + 3 == long.index("12.5") + 4  # right-aligned, one edge
    assert short.index("x") == long.index("a note") == head.index("note")  # left-aligned, one edge
    assert rule == "-" * len(head) and len(long) > len(head)  # the last column's overflow widens nothing
    assert table([("a", 3)], [["1"]], indent="  ")[0] == "    a" and table([("a", 3)], [["1"]], indent="  ")[1] == "  ---"


def test_numbers_are_gigabytes_and_ratios_or_a_dash():
    assert (gb(1_234_567_890), gb(1_234_567_890, 2), gb(None)) == ("1.2346", "1.23", "-")
    assert (ratio(1.0456), ratio(None)) == ("1.046x", "-")
