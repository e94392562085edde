"""Sizes in bytes as deploy files write them (deploy/byte_sizes.py), against hand-computed values."""

from __future__ import annotations

import pytest

from raylm.deploy.byte_sizes import format_bytes, format_bytes_of, parse_byte_size


@pytest.mark.parametrize("written, size", [
    (0, 0),
    (1073741824, 1073741824),
    (4e9, 4_000_000_000),  # YAML reads 4.0e+9 as a float: a whole number of bytes is fine
    ("4096", 4096),
    ("17B", 17),
    ("8GiB", 8 * 1024**3),
    ("8 gib", 8 * 1024**3),
    ("512MB", 512_000_000),
    ("512mb", 512_000_000),
    ("1.5GiB", 1_610_612_736),  # 1.5 * 1073741824
    ("0.25 KiB", 256),
    ("2kB", 2000),
    ("3TB", 3_000_000_000_000),
    ("1TiB", 1_099_511_627_776),
    (".5MiB", 524_288),
])
def test_sizes_in_units(written, size):
    assert parse_byte_size(written) == size


@pytest.mark.parametrize("written, message", [
    (-1, ">= 0"),
    ("-2GiB", ">= 0"),
    (1.5, "whole number of bytes, and this is 1.5 bytes"),
    ("0.5B", "whole number of bytes"),
    ("0.001KiB", "whole number of bytes"),  # 1.024 bytes
    ("8G", "'G' alone is ambiguous: write GiB or GB"),
    ("512m", "'m' alone is ambiguous: write MiB or MB"),
    ("8XB", "unknown unit 'XB'"),
    ("lots", "not a size"),
    ("8 GiB of it", "not a size"),
    ("", "not a size"),
    (True, "not true/false"),
    (float("inf"), "finite"),
    ([8], "not list"),
])
def test_mistakes_say_what_is_wrong(written, message):
    with pytest.raises(ValueError, match=message):
        parse_byte_size(written)


def test_sizes_printed_for_people():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(4 * 1024**3) == "4.0 GiB"
    assert format_bytes(3 * 1024**4) == "3.0 TiB"
    assert format_bytes_of(1288490189, 4 * 1024**3) == "1.2/4.0 GiB"  # 1.2 GiB = 1288490188.8 bytes
    assert format_bytes_of(0, 512) == "0/512 B"
    assert format_bytes_of(3 << 20, 1 << 30) == "0.0/1.0 GiB"
