// Package doctest holds the test that compiles every ```go block of the
// README and of docs/: a snippet in a doc is code, and it keeps compiling
// as the API moves. See docs_test.go for how fragments are wrapped and how a
// block opts out (```go nocompile).
package doctest
