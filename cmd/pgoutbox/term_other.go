//go:build !linux && !darwin && !freebsd && !netbsd && !openbsd

package main

import "os"

// fileIsTerminal reports false where the terminal check is not
// implemented: commands that change data then need --yes.
func fileIsTerminal(*os.File) bool { return false }
