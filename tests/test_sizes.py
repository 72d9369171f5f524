import pytest

from omni_dp.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1K", 1000),
        ("1kb", 1000),
        ("2M", 2 * 1000**2),
        ("3MB", 3 * 1000**2),
        ("2G", 2 * 1000**3),
        ("2GB", 2 * 1000**3),
        ("1T", 1000**4),
        ("1TB", 1000**4),
    ],
)
def test_decimal_units_are_powers_of_1000(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1KiB", 1024),
        ("512MiB", 512 * 1024**2),
        ("2GiB", 2 * 1024**3),
        ("1TiB", 1024**4),
    ],
)
def test_binary_units_are_powers_of_1024(text, expected):
    assert parse_size(text) == expected


def test_decimal_and_binary_units_differ():
    assert parse_size("1GiB") - parse_size("1GB") == 1024**3 - 1000**3


def test_units_are_case_insensitive():
    assert parse_size("2gib") == parse_size("2GIB") == parse_size("2GiB")


def test_plain_number_is_bytes():
    assert parse_size("4096") == 4096
    assert parse_size("4096B") == 4096
    assert parse_size("0") == 0


def test_whitespace_around_and_between_number_and_unit_is_allowed():
    assert parse_size("  2 GiB  ") == 2 * 1024**3


def test_int_passes_through():
    assert parse_size(12345) == 12345


def test_negative_int_raises():
    with pytest.raises(ValueError, match="negative"):
        parse_size(-1)


def test_fraction_with_unit():
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1.5GiB") == 3 * 1024**3 // 2
    assert parse_size("0.5KiB") == 512


def test_fractional_bytes_round_down():
    assert parse_size("1.9") == 1
    assert parse_size("1.5KiB") == 1536
    assert parse_size("0.0001K") == 0


def test_exact_decimal_fraction_is_not_rounded_below_its_value():
    assert parse_size("2.01K") == 2010
    assert parse_size("4.02K") == 4020


@pytest.mark.parametrize(
    "text",
    ["", "abc", "GiB", "1.5.2G", "-1G", "1 XB", "1GiBs", "1e9", "1,000", ".5G", "2 G B"],
)
def test_bad_strings_raise_with_accepted_forms(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    message = str(info.value)
    assert repr(text) in message
    # The message teaches the accepted forms: plain bytes, binary and decimal units.
    for example in ("4096", "512MiB", "2GiB", "1.5GB"):
        assert example in message


@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (512 * 1024**2, "512.00 MiB"),
        (3 * 1024**3 // 2, "1.50 GiB"),
        (2 * 1024**4, "2.00 TiB"),
    ],
)
def test_format_size_uses_largest_binary_unit(num_bytes, expected):
    assert format_size(num_bytes) == expected


@pytest.mark.parametrize("num_bytes", [1, 1000, 4096, 512 * 1024**2, 2 * 1024**3, 5 * 1024**4])
def test_format_then_parse_round_trips_exact_binary_sizes(num_bytes):
    text = format_size(num_bytes).replace(" ", "")
    assert parse_size(text) == num_bytes
