// Every backward main kernel, one line each: FA3_BWD_KERNEL(NAME, padded head dim, dtype), which the
// file that includes this one defines (as kernels/flash_fwd/instances.h: kernel.cu compiles them,
// kernels/smem_table.cpp sizes their shared memory at build time). No include guard.
// Instantiations: padded head dim 64, 128 and 256 per dtype; any other multiple of 8 up to 256
// runs on the next one up with TMA zero-filling the missing columns.
FA3_BWD_KERNEL(flash_bwd_d64_bf16, 64, fa3::DT_BF16)
FA3_BWD_KERNEL(flash_bwd_d128_bf16, 128, fa3::DT_BF16)
FA3_BWD_KERNEL(flash_bwd_d256_bf16, 256, fa3::DT_BF16)
FA3_BWD_KERNEL(flash_bwd_d64_f16, 64, fa3::DT_F16)
FA3_BWD_KERNEL(flash_bwd_d128_f16, 128, fa3::DT_F16)
FA3_BWD_KERNEL(flash_bwd_d256_f16, 256, fa3::DT_F16)
