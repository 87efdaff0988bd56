package tests

import (
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// TestMain drops the schemas kept for reuse and fails the run if a test
// left a schema behind.
func TestMain(m *testing.M) { pgoutboxtest.Main(m) }
