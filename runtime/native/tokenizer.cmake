# The tokenizer as its own library: no ExecuTorch, so mtp-tokenize (and the tokenizer tests)
# build without the rest of the core. Included by CMakeLists.txt; the core links it.
set(TOKENIZER_SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/src/tokenizer.cpp
                      ${CMAKE_CURRENT_SOURCE_DIR}/src/split_regex.cpp
                      ${CMAKE_CURRENT_SOURCE_DIR}/src/unicode.cpp)
add_library(mtp_tokenizer STATIC ${TOKENIZER_SOURCES})
set_target_properties(mtp_tokenizer PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(mtp_tokenizer PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/src)
target_compile_options(mtp_tokenizer PRIVATE -Wall -Wextra)
target_link_libraries(mtp_tokenizer PUBLIC nlohmann_json::nlohmann_json)

add_executable(mtp-tokenize tools/mtp_tokenize.cpp)
target_link_libraries(mtp-tokenize PRIVATE mtp_tokenizer)
