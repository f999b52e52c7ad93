// The mark (mark.h). Its operands: `label`, int32 [tick, action, microbatch, virtual stage],
// and `after`, any buffer the mark must follow; its results are the same two buffers (the
// lowering aliases them, so nothing is copied). Recording costs one event, like a psend's;
// with tracing off the handler only passes its operands through.
#include "ffi/mark.h"

#include <cstring>

#include "common/trace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// An aliased result is its operand's buffer; otherwise (XLA chose to copy) copy it over.
void PassThrough(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != in.untyped_data()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

ffi::Error MarkImpl(int32_t device_ordinal, ffi::AnyBuffer label, ffi::AnyBuffer after,
                    ffi::Result<ffi::AnyBuffer> label_out, ffi::Result<ffi::AnyBuffer> after_out) {
  if (label.element_type() != ffi::DataType::S32 || label.element_count() != 4) {
    return ffi::Error::InvalidArgument(
        "jax_cpu_mpi mark: the label must be int32[4] (tick, action, microbatch, virtual "
        "stage)");
  }
  if (jcm::trace::Mode() != 0) {
    const int32_t* words = label.typed_data<int32_t>();
    jcm::trace::Event e;
    e.start_ns = jcm::trace::NowNs();
    e.process = jcm::trace::ThisProcess();
    e.device = device_ordinal;  // this process's device ordinal: Python maps it to the id
    e.seq = static_cast<uint64_t>(words[0]);
    e.op = jcm::trace::Op::kMark;
    e.label[0] = words[1];
    e.label[1] = words[2];
    e.label[2] = words[3];
    jcm::trace::Record(e);
  }
  PassThrough(label, label_out);
  PassThrough(after, after_out);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcmMark, MarkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
