#pragma once

// Golden numbers for the LLaVA-NeXT model test, printed by the independent PyTorch transcription of HF's
// LlavaNextForConditionalGeneration (CLIP vision tower, LlavaNextMultiModalProjector, anyres packing with
// unpad and image_newline, Llama text model) in tests/model/reference/llava_next_reference.py on
// hash-derived weights (run with /usr/bin/python3 + Debian's python3-torch, then clang-format; never
// produced by this library's code). Each row runs on its own, unpadded, with positions 0..L-1; an image
// is kCount<X> copies of token 90 (LlavaNextProcessor's count, equal to pack_image_features' rows):
//   k<Case>Embedding: the packed image rows (images in order) projected on u_hidden
//   k<Case>Row<r>: the logits of row r projected on u_vocab (one number per token)
// Images (pixels key, original (h, w) -> best pinpoint (h, w), tiles incl. the base):
//   A: 1001, (10, 30) -> (8, 24), 4
//   B: 1002, (20, 12) -> (16, 16), 5
//   C: 1003, (20, 12) -> (16, 16), 5
//   D: 1004, (12, 20) -> (16, 16), 5
//
// Planted changes, effect on kBatchRow0 (max|diff|) or on the counts:
//   image_newline rows dropped: rows A 16, B/C 12 (placeholders 18, 16)
//   image_newline zeroed (rows kept): 1.699
//   image_sizes of B/C as (12, 20) (same 5 tiles): placeholders and rows 14 / 14 (vs 16)
//   vision_feature_layer -1: 0.2292
//   "full" strategy (CLS kept): placeholders A 19, B/C 17 (vs 18, 16); pack_image_features raises (its view gives 80
//     channels, image_newline has 64)
//   unpad skipped: rows A 18, B/C 24 (placeholders 18, 16); A's unpad is a no-op
//   tiles not interleaved (permute 4,0,1,2,3): 1.778

#include <vector>

namespace vlmgen::llava_next_test::golden {

constexpr int kCountA = 18;
constexpr int kCountB = 16;
constexpr int kCountC = 16;
constexpr int kCountD = 14;

const std::vector<double> kTextRow0 = {0.5954688, 0.9219338, 0.4679455, -1.750297, 1.298091,  1.245691,
                                       1.955005,  0.4432665, 2.922931,  -1.331677, 0.9695897, 0.1444782};
// Text: max |logit| 1.395; greedy last: [33]
const std::vector<double> kOneImageEmbedding = {
    0.2628433,   -0.4543543, 0.4647893, 0.2047215, -0.1065391,  -0.3968869, 0.1147444, -0.1049722,  0.1978592,
    -0.03803441, -0.7921835, 0.2016175, 0.2275219, -0.01889703, 0.2038338,  0.2819084, -0.01356317, -0.7921835};
const std::vector<double> kOneImageRow0 = {0.5954688,  0.8372569,  0.7226463, -0.1846449, 1.487474,   -0.0381059,
                                           -0.1875389, -0.3585977, 0.9015024, -0.3512391, 1.340045,   -0.5028169,
                                           -0.3968983, 1.454318,   0.1187372, -0.4463972, -0.2243661, 1.420167,
                                           -0.6784241, -0.371579,  2.373838,  2.31903};
// OneImage: max |logit| 1.479; greedy last: [83]
const std::vector<double> kBatchEmbedding = {
    0.2628433,   -0.4543543, 0.4647893, 0.2047215,   -0.1065391,  -0.3968869, 0.1147444,  -0.1049722,  0.1978592,
    -0.03803441, -0.7921835, 0.2016175, 0.2275219,   -0.01889703, 0.2038338,  0.2819084,  -0.01356317, -0.7921835,
    -0.434293,   0.1626468,  0.1732751, -0.02775095, -0.364192,   0.03195779, -0.7921835, -0.2198656,  0.04248944,
    -0.7921835,  -0.5837741, 0.2387827, -0.7921835,  -0.4089629,  0.2303991,  -0.7921835, 0.3120866,   -0.08193423,
    0.5864322,   0.3727641,  0.5553343, 0.06066604,  -0.7921835,  0.01417229, 0.418922,   -0.7921835,  -0.3889788,
    -0.02402373, -0.7921835, 0.299671,  0.170421,    -0.7921835};
const std::vector<double> kBatchRow0 = {
    0.595469,  -0.1712531,  1.847864,   -0.454996,  1.738591,   0.6799205, 0.8145009,   0.02364112,
    1.292596,  -0.06371102, 1.482367,   -0.1407863, -0.317605,  1.649836,  0.730183,    -0.02821589,
    0.3112397, 1.707134,    -0.2275607, -0.3164667, 0.4330377,  0.6808537, 0.5650806,   0.8703057,
    0.891303,  -0.4579487,  0.6828935,  -0.1190707, 0.5859392,  1.594802,  -0.01721911, 0.3697088,
    1.001344,  -0.1191751,  0.1109905,  1.187965,   -0.1150119, 3.084674};
const std::vector<double> kBatchRow1 = {0.5954688,  2.507689,   1.955053,   -0.1435555, 1.846276,
                                        -0.3228506, -0.4934516, 1.053731,   -1.344779,  0.09040608,
                                        1.032382,   -0.7824897, 0.155496,   1.21,       -0.8506877,
                                        2.000101,   1.171482,   -0.6829384, -0.2400468, -0.4393735};
// Batch: max |logit| 1.611; greedy last: [83, 24]
const std::vector<double> kTurnsEmbedding = {
    0.2628433,   -0.4543543,  0.4647893,  0.2047215,    -0.1065391, -0.3968869,  0.1147444, -0.1049722,
    0.1978592,   -0.03803441, -0.7921835, 0.2016175,    0.2275219,  -0.01889703, 0.2038338, 0.2819084,
    -0.01356317, -0.7921835,  0.6944243,  0.0006955213, 0.5763521,  -0.2892451,  0.41903,   -0.2684476,
    0.4534787,   -0.04573945, -0.7921835, 0.380151,     -0.1186628, -0.06326137, -0.221449, -0.7921835};
const std::vector<double> kTurnsRow0 = {
    0.595469,   0.3939249, -3.130552, -0.4031457, 2.441866,   0.5086463,   2.023738,   -0.03518742,
    0.7708181,  0.52954,   1.526529,  0.2069096,  1.63287,    -0.09600545, -0.3116708, 1.79897,
    0.7852145,  0.1137806, 0.4591981, 1.897894,   -0.4223264, -0.2552384,  0.9774202,  0.09608122,
    1.470369,   1.309411,  0.7296251, -1.043089,  0.9853466,  -0.8901689,  1.980516,   -0.2785488,
    -0.1343101, 0.9026942, 0.6305496, 1.499719,   0.7152664,  -0.05204125, 1.43482,    1.845317};
// Turns: max |logit| 1.506; greedy last: [83]

}  // namespace vlmgen::llava_next_test::golden
