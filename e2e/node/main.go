// Command kvtier-node is one multi-call binary holding the node side of kvtier's test cluster: the upstream
// kubelet and kube-scheduler (k8s.io/kubernetes at the version go.mod pins; the bodies are upstream's
// cmd/kubelet/kubelet.go and cmd/kube-scheduler/scheduler.go). The control plane (../controlplane) has no
// scheduler because it had no node; a real one places pods here the way it does on any cluster.
//
// This module pins the same module versions as ../controlplane, so the packages both link are compiled once
// and shared through Go's build cache; it is a module of its own so that building it never invalidates the
// control plane's cached binary. The mode is taken from the name it was called by (kubelet, kube-scheduler, as
// symlinks in the cache directory) or from the first argument.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubeletapp "k8s.io/kubernetes/cmd/kubelet/app"
	schedulerapp "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	mode, args := filepath.Base(os.Args[0]), os.Args[1:]
	if mode != "kubelet" && mode != "kube-scheduler" {
		if len(args) == 0 {
			fmt.Fprintln(os.Stderr, "usage: kvtier-node kubelet|kube-scheduler [ARGS...]")
			os.Exit(2)
		}
		mode, args = args[0], args[1:]
	}
	switch mode {
	case "kubelet":
		command := kubeletapp.NewKubeletCommand(context.Background())
		command.SetArgs(args)
		os.Exit(cli.Run(command))
	case "kube-scheduler":
		command := schedulerapp.NewSchedulerCommand()
		command.SetArgs(args)
		os.Exit(cli.Run(command))
	default:
		fmt.Fprintf(os.Stderr, "kvtier-node: unknown mode %q (want kubelet or kube-scheduler)\n", mode)
		os.Exit(2)
	}
}
