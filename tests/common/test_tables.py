"""labkit.common.tables: the one shape of the lab's measured tables."""
from labkit.common.tables import Col, table


def test_a_table_is_its_lines_above_a_header_placed_by_the_specs_and_one_line_per_row():
    rows = [{"name": "ring", "t": 0.0012, "n": 2}, {"name": "dist.all_reduce", "t": 0.001, "n": 12}]
    text = table([Col("impl", "name", "<16"), Col("time ms", lambda r: r["t"] * 1e3, ">9.3f"),
                  Col("ranks", "n", ">5,")], rows, above=["measured"], below=["done"])
    assert text.splitlines() == [
        "measured",
        "impl               time ms ranks",
        "ring                 1.200     2",
        "dist.all_reduce      1.000    12",
        "done"]


def test_a_last_column_without_width_leaves_no_trailing_blanks():
    assert table([Col("a", "a", ">3"), Col("link", "l", "<")], [{"a": 1, "l": ""}],
                 sep="  ") == "  a  link\n  1"
