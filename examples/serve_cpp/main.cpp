// Loads a package from `python -m app export --format pt2` and scores the rows of a Criteo TSV file
// (label, I1..I13, C1..C26 or, unlabelled, I1..I13, C1..C26; an empty field is 0): prints one click
// probability per row, in order. The package maps the raw ids and transforms the counts itself, so the
// server only turns the text into two int64 tensors, dense_counts (B, 13) and raw_ids (B, 26).
//
//   serve_pt2 model.pt2 rows.tsv [--unlabelled]
// Only what it uses (not <torch/torch.h>): the example then compiles in a few seconds.
#include <ATen/ops/from_blob.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdint>
#include <stdexcept>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr int kDense = 13;
constexpr int kSparse = 26;

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> fields;
  std::stringstream stream(line);
  std::string field;
  while (std::getline(stream, field, '\t')) fields.push_back(field);
  if (!line.empty() && line.back() == '\t') fields.emplace_back();
  return fields;
}

// Reads the rows into (B, 13) counts and (B, 26) raw ids; trailing empty fields may be stripped.
void read_rows(const std::string& path, bool labelled, std::vector<int64_t>& dense, std::vector<int64_t>& ids) {
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open " + path);
  std::string line;
  while (std::getline(file, line)) {
    auto fields = split_tabs(line);
    size_t first = labelled ? 1 : 0;
    fields.resize(first + kDense + kSparse);
    for (int j = 0; j < kDense; ++j) {
      const auto& f = fields[first + j];
      dense.push_back(f.empty() ? 0 : std::stoll(f));
    }
    for (int j = 0; j < kSparse; ++j) {
      const auto& f = fields[first + kDense + j];
      ids.push_back(f.empty() ? 0 : static_cast<int64_t>(std::stoull(f, nullptr, 16)));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: serve_pt2 model.pt2 rows.tsv [--unlabelled]\n";
    return 2;
  }
  const bool labelled = !(argc > 3 && std::string(argv[3]) == "--unlabelled");
  std::vector<int64_t> dense, ids;
  read_rows(argv[2], labelled, dense, ids);
  const int64_t rows = static_cast<int64_t>(dense.size() / kDense);
  if (rows == 0) {
    std::cerr << "error: " << argv[2] << " holds no rows\n";
    return 2;
  }
  auto options = at::TensorOptions().dtype(at::kLong);
  auto dense_counts = at::from_blob(dense.data(), {rows, kDense}, options);  // views of the vectors
  auto raw_ids = at::from_blob(ids.data(), {rows, kSparse}, options);

  torch::inductor::AOTIModelPackageLoader loader(argv[1]);  // the package's compiled model
  // A package exported on a GPU runs there: the inputs go to the device it was compiled for.
  const c10::Device device(loader.get_metadata().at("AOTI_DEVICE_KEY"));
  auto probabilities = loader.run({dense_counts.to(device), raw_ids.to(device)})[0].cpu();
  auto values = probabilities.contiguous().data_ptr<float>();
  std::cout.precision(9);
  for (int64_t i = 0; i < rows; ++i) std::cout << values[i] << "\n";
  return 0;
}
