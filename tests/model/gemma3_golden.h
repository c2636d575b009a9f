#pragma once

// Golden numbers for the Gemma-3 model test, printed by the independent PyTorch transcription of HF's
// Gemma3ForConditionalGeneration (Gemma3 text model, SigLIP vision tower, Gemma3MultiModalProjector) in
// tests/model/reference/gemma3_reference.py on hash-derived weights (run with /usr/bin/python3 + Debian's
// python3-torch, then clang-format; never produced by this library's code). Each row runs on its own,
// unpadded, with positions 0..L-1:
//   k<Case>Embedding: the projector's output rows (4 per image, images in order) projected on u_hidden
//   k<Case>Row<r>: the logits of row r projected on u_vocab (one number per token)
//
// OneImage: making image attention causal moves kOneImageRow0 by max|diff| 4.942.
// Planted changes, max|diff| they cause in kBatchRow0 / kTextRow0:
//   causal image attention: 3.118 / 0
//   sliding window ignored: 3.789 / 2.04
//   local RoPE base 1e6 with linear scaling: 2.173 / 1.629
//   RMSNorm scale w instead of 1 + w: 3.297 / 3.197

#include <vector>

namespace vlmgen::gemma3_test::golden {

const std::vector<double> kTextRow0 = {-1.226801, -2.289653, -2.846792, -1.162766, 1.451207,  1.755951,  -0.09312975,
                                       2.54727,   0.7511892, -1.959861, -1.675217, -2.421454, -1.639161, -1.991009};
// Text: max |logit| 1.37; greedy last: [74]
const std::vector<double> kOneImageEmbedding = {1.729237, 0.743886, 1.598054, -2.874664};
const std::vector<double> kOneImageRow0 = {-1.226801, -1.632893, -2.911365, 3.904177, 2.467584, 2.019276,
                                           2.683836,  0.8613646, 1.878138,  2.686947, 3.737209, 1.504541};
// OneImage: max |logit| 1.616; greedy last: [24]
const std::vector<double> kBatchEmbedding = {1.729237,  0.743886,    1.598054, -2.874664,  1.255368, 0.1651051,
                                             0.8768234, -0.02547704, 3.118976, -0.7458405, 1.52,     0.9418638};
const std::vector<double> kBatchRow0 = {-1.226801, -2.289653,   -2.9557,   -0.6622731, -0.4218037, -0.1344042,
                                        0.1836679, 0.004337065, 0.8916034, 1.518814,   2.087491,   3.726582,
                                        2.296107,  2.142944,    1.58018,   -0.7064425, 1.072914};
const std::vector<double> kBatchRow1 = {-1.226801, -1.157458, -3.140985, -1.879759, -1.251507,
                                        -1.462458, -2.094156, -3.415159, -2.224576, 0.588707};
// Batch: max |logit| 1.541; greedy last: [51, 57]
const std::vector<double> kTurnsEmbedding = {0.8834569, -0.605874, -0.4047837, 0.1843531};
const std::vector<double> kTurnsRow0 = {-1.226801, -0.3638738, -3.080425, -1.587666, -3.022417, -3.554213,
                                        -3.282795, -2.912523,  -1.336547, -2.258234, -1.376935, -0.9478476,
                                        0.323997,  0.1132616,  -1.402064, 2.447777,  3.634944};
// Turns: max |logit| 1.505; greedy last: [58]

}  // namespace vlmgen::gemma3_test::golden
