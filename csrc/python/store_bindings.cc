// The rendezvous store's server and client in Python (_C.StoreServer, _C.StoreClient):
// horovodrun's driver serves the store, workers and foreign launchers' bootstraps read
// and write it (horovod_torch/engine/rendezvous.py, horovod_torch/runner).
#include <torch/extension.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "python/module_state.h"
#include "rendezvous/store.h"

namespace py = pybind11;

namespace hvd {

void BindStore(py::module_& m) {
  py::class_<StoreServer>(m, "StoreServer")
      .def(py::init([](const std::string& host, int port, const std::string& secret,
                       uint64_t max_frame) {
             StoreOptions options;
             options.max_frame = max_frame;  // requests above it are refused
             auto s = std::make_unique<StoreServer>(host, port, secret, options);
             if (!s->status().ok()) throw std::runtime_error(s->status().message());
             return s;
           }),
           py::arg("host"), py::arg("port"), py::arg("secret"),
           py::arg("max_frame") = kStoreMaxFrame)
      .def("port", &StoreServer::port)
      .def("set", [](StoreServer& s, const std::string& k, const py::bytes& v) { s.Set(k, v); })
      .def("get",
           [](StoreServer& s, const std::string& k) -> py::object {
             std::string v;
             if (!s.Get(k, &v)) return py::none();
             return py::bytes(v);
           })
      .def("add",
           [](StoreServer& s, const std::string& k, int64_t delta) {
             int64_t out = 0;
             if (!s.Add(k, delta, &out)) {
               throw py::value_error("store key '" + k + "' does not hold an integer");
             }
             return out;
           })
      .def("stop", &StoreServer::Stop, py::call_guard<py::gil_scoped_release>());

  // Used by elastic workers to read their assignment and host updates.
  py::class_<StoreClient>(m, "StoreClient")
      .def(py::init(
               [](const std::string& host, int port, const std::string& secret, double timeout_s) {
                 std::unique_ptr<StoreClient> c;
                 Status st;
                 {
                   py::gil_scoped_release nogil;
                   st = StoreClient::Connect(host, port, secret, timeout_s, &c);
                 }
                 if (!st.ok()) throw std::runtime_error(st.message());
                 return c;
               }),
           py::arg("host"), py::arg("port"), py::arg("secret"), py::arg("timeout_s") = 30.0)
      .def("set",
           [](StoreClient& c, const std::string& k, const py::bytes& v) {
             std::string value = v;
             Status st;
             {
               py::gil_scoped_release nogil;
               st = c.Set(k, value);
             }
             if (st.code() == StatusCode::kInvalidArgument) throw py::value_error(st.message());
             if (!st.ok()) throw std::runtime_error(st.message());
           })
      .def(
          "get",
          [](StoreClient& c, const std::string& k, double timeout_s) -> py::object {
            std::string v;
            Status st;
            {
              py::gil_scoped_release nogil;
              st = c.Get(k, timeout_s, &v);
            }
            if (!st.ok()) return py::none();
            return py::bytes(v);
          },
          py::arg("key"), py::arg("timeout_s") = 0.0)
      .def("add", [](StoreClient& c, const std::string& k, int64_t delta) {
        int64_t out = 0;
        Status st;
        {
          py::gil_scoped_release nogil;
          st = c.Add(k, delta, &out);
        }
        if (!st.ok()) throw std::runtime_error(st.message());
        return out;
      });
}

}  // namespace hvd
