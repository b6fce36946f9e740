//go:build tools

package tools

import _ "github.com/fluxcd/kustomize-controller"
