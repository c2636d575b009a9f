// Built against the installed package: header-only core plus the compiled library.
#include <vlmgen/build_info.h>
#include <vlmgen/generator.h>
#include <vlmgen/testing/fake_vlm.h>

#include <cstdio>

int main() {
  vlmgen::testing::FakeVlm model;
  auto out = vlmgen::Generator(model).generate({{{1, 2, 3}}}, vlmgen::GenerationConfig().max_new_tokens(3));
  std::printf("%s: %zu tokens\n", vlmgen::build_info().c_str(), out.sequences[0].tokens.size());
  return out.sequences[0].tokens.size() == 3 ? 0 : 1;
}
