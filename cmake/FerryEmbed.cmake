# Embeds OpenCL kernel files into a C++ source as raw string literals, keyed by file stem,
# so kernels stay real, lintable .cl files while the library ships as one binary.
function(ferry_embed_kernels output)
  set(inputs ${ARGN})
  add_custom_command(
    OUTPUT ${output}
    COMMAND ${CMAKE_COMMAND} -DOUTPUT=${output} "-DINPUTS=${inputs}" -P ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/FerryEmbedRun.cmake
    DEPENDS ${inputs} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/FerryEmbedRun.cmake
    COMMENT "Embedding ${CMAKE_ARGC} OpenCL kernel files")
endfunction()
