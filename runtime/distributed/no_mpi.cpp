// A ferry built without MPI (libopenmpi-dev was not found at configure time): one rank only.
#include <stdexcept>

#include "ferry/runtime/distributed.hpp"

namespace ferry {

bool built_with_mpi() {
  return false;
}

std::shared_ptr<ops::Communicator> mpi_world() {
  throw std::runtime_error(
      "this ferry was built without MPI, so it cannot train over several ranks: install libopenmpi-dev and "
      "openmpi-bin (the quick start does) and configure and build again");
}

}  // namespace ferry
