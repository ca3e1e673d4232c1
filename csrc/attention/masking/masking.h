// Masking in scaled dot-product attention: which keys each query row may
// attend, and what becomes of the scores of the others, in one place for
// every path (flash tiles, weights tile, rows).
//
//   key_range.h     the band of keys a row may attend (causal, window, key
//                   and query lengths), and the keys of a block rows read
//   merged_masks.h  a row's masks summed as torch sums them; apply_masks and
//                   key_closed, a row at a time
//   shared_masks.h  the masks of several rows as one row (a padding mask):
//                   the keys it closes to all, and where it adds 0
//   mask_blocks.h   the map of the mask blocks closed or zero for a whole
//                   query tile
//   tile_masks.h    TileMasks: a query tile's bands and masks (tile paths)
//   row_masks.h     RowMasks: those of the rows of a row-path task
//   non_finite.h    -inf, NaN and +inf in the softmax
//
// Each path asks the same of a block of keys of its rows: classify() says
// what the bands and masks make of it (MaskBlock: kClosed, skipped, no term
// of any sum; kZero, the masks add 0 and are not read; kMixed), and apply()
// closes the scores' entries they close (-inf by selection, never by
// addition, so that a NaN in a closed key's value cannot reach the row) and
// adds the masks to the others. The weights path of long key sequences
// (rows_with_weights) applies them a whole row at a time with apply_masks.
#pragma once

#include "attention/masking/key_range.h"
#include "attention/masking/mask_blocks.h"
#include "attention/masking/merged_masks.h"
#include "attention/masking/non_finite.h"
#include "attention/masking/row_masks.h"
#include "attention/masking/shared_masks.h"
#include "attention/masking/tile_masks.h"
