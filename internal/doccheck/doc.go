// Package doccheck holds the test that keeps the documentation honest:
// every Go snippet in README.md and docs/ is an excerpt of code that
// compiles and runs (an example under _examples, an Example function, a
// test), named by a marker above it, and every relative link points at a
// file that exists.
//
// A snippet is marked like this, on the line before its fence:
//
//	<!-- snippet: _examples/basic/main.go -->
//
// Its lines, with leading and trailing blanks trimmed, must appear in that
// file in the same order (other lines may come between them); a line
// "// …" stands for lines left out. Change the code, and the snippet that
// no longer matches fails the test, naming its first stale line.
package doccheck
