# Build settings shared by kvevict's own tests, tools and benchmarks (never imposed on consumers).
find_package(OpenMP REQUIRED COMPONENTS CXX)

add_library(kvevict_dev INTERFACE)
target_link_libraries(kvevict_dev INTERFACE kvevict::kvevict OpenMP::OpenMP_CXX)
target_compile_options(kvevict_dev INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion -Werror>)
if(KVEVICT_SANITIZE)
  target_compile_options(kvevict_dev INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer>)
  target_link_options(kvevict_dev INTERFACE -fsanitize=address,undefined)
endif()
