"""Checkers for what users hand kvlab: values (numbers, seeds, token ids, text, sizes) and files (paths, text
and JSON read from disk). `from kvlab import validate; validate.token_ids(...)` reaches both."""

from kvlab.validate.files import decode_text, existing_path, path_text, read_json_object, read_text
from kvlab.validate.values import (MAX_SEED, RANDOM_SEED, compute_dtype, finite_float, int_in_range, is_int,
                                   is_real, json_dict, optional_int, out_of_vocab, parse_size, positive_float, positive_int,
                                   seed, text, token_ids)

__all__ = ["MAX_SEED", "RANDOM_SEED", "compute_dtype", "decode_text", "existing_path", "finite_float",
           "int_in_range", "is_int", "is_real", "json_dict", "optional_int", "out_of_vocab", "parse_size", "path_text",
           "positive_float", "positive_int", "read_json_object", "read_text", "seed", "text", "token_ids"]
