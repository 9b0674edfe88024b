#include "transport_registry.h"

#include <c10/util/Exception.h>

#include <map>
#include <sstream>
#include <utility>

namespace fused_reducer {
namespace {

// A function-local static: registrations run during static initialisation, in any order of
// the translation units.
std::map<std::string, TransportFactory>& registry() {
  static std::map<std::string, TransportFactory> factories;
  return factories;
}

}  // namespace

TransportRegistration::TransportRegistration(const char* name, TransportFactory factory) {
  const bool added = registry().emplace(name, std::move(factory)).second;
  TORCH_INTERNAL_ASSERT(added, "FusedReducer: transport '", name, "' registered twice");
}

std::shared_ptr<Transport> make_registered_transport(const std::string& name,
                                                     const TransportArgs& args) {
  const auto found = registry().find(name);
  if (found == registry().end()) {
    std::ostringstream known;
    for (const auto& name_and_factory : registry()) {
      known << (known.tellp() > 0 ? ", " : "") << "'" << name_and_factory.first << "'";
    }
    TORCH_CHECK(false, "FusedReducer: no transport '", name, "' in this build (it has ",
                known.str(), ")");
  }
  return found->second(args);
}

std::vector<std::string> registered_transports() {
  std::vector<std::string> names;
  for (const auto& name_and_factory : registry()) {
    names.push_back(name_and_factory.first);
  }
  return names;
}

}  // namespace fused_reducer
