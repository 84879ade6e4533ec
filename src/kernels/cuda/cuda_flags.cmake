# Shared by src/kernels/cuda/CMakeLists.txt and the GPU-machine project in bench/gpu/: the CUDA language setup and
# the flags of every CUDA target. Include after enable_language(CUDA).
find_package(CUDAToolkit REQUIRED)
# CMake 3.25 knows nvcc's dialect flags only up to C++17; nvcc 12+ accepts -std=c++20.
if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)

# Hopper machine code (sm_90a, so wgmma/setmaxnreg are available) plus compute_90 PTX, which any later GPU's
# driver can compile. The architectures are given as flags, not CUDA_ARCHITECTURES, so that the "a" variant is
# spelled exactly as nvcc wants it.
function(kestrel_cuda_target target)
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90
                               -Xptxas=-warn-spills --expt-relaxed-constexpr>)
  target_link_libraries(${target} PUBLIC CUDA::cudart CUDA::cublasLt)  # cuBLASLt: the bf16 GEMMs (gemm.h)
endfunction()
