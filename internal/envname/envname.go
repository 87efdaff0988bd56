// Package envname tells a misspelt environment variable from the one it
// was meant to be, for the library's *ConfigFromEnv and the CLI alike.
package envname

import (
	"runtime"
	"strings"
)

// Misspelt reports whether key is known spelt with other underscores or
// case (PGOUTBOX_MAXINFLIGHT for PGOUTBOX_MAX_IN_FLIGHT): read by nobody,
// its setting would be ignored without a word. On Windows, whose variable
// names ignore case, a difference of case alone is no misspelling: the
// variable is read.
func Misspelt(key, known string) bool {
	if key == known || runtime.GOOS == "windows" && strings.EqualFold(key, known) {
		return false
	}
	return squash(key) == squash(known)
}

func squash(s string) string { return strings.ToUpper(strings.ReplaceAll(s, "_", "")) }
